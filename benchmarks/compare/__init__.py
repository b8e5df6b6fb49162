"""`python -m benchmarks.compare`: every engine on the same short job, beside the loops people
write by hand. driver.py is the driver, runs.py what it runs and reads back, report.py what it
writes, reference.py one rank of the nanoGPT-style loop (benchmarks/peer_hf.py: the HF Trainer's)."""
