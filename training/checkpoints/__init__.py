"""Checkpoints on disk: the layout and the rule that makes a save safe to kill (layout.py), their
integrity listings (integrity.py), what a run resumes from (resume.py), universal copies for
another world size or stage (universal.py), reading ZeRO files one parameter at a time
(zero_files.py), the weights of any checkpoint (weights.py) and export to a Hugging Face folder
(export.py)."""
