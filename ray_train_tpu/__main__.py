import sys

from ray_train_tpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
