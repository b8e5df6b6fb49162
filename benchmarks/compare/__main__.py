from benchmarks.compare.driver import main
from training.runtime import distributed

if __name__ == "__main__":
    distributed.exit_process(main())
