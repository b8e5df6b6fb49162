from benchmarks.compare.command import main
from training.runtime import distributed

if __name__ == "__main__":
    distributed.exit_process(main())
