"""The launcher argv every test, benchmark and driver starts its ranks with."""

import pytest

from launch.launcher_argv import launcher_command


def test_torchrun_and_deepspeed_argv():
    py = "/venv/bin/python"
    assert launcher_command("torchrun", 2, ["training/train.py", "--steps", "2"], 29555, py) == [
        py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29555",
        "training/train.py", "--steps", "2",
    ]  # fmt: skip
    assert launcher_command("torchrun", 1, ["-m", "launch.doctor"], python=py) == [
        py, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "launch.doctor",
    ]  # fmt: skip
    assert launcher_command("deepspeed", 2, ["t.py"], 7, py) == [
        "/venv/bin/deepspeed", "--num_gpus", "2", "--master_port", "7", "t.py",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="launcher"):
        launcher_command("mpirun", 2, ["t.py"])
