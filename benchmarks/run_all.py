"""Run every benchmark script in this folder (``make bench``); each writes
benchmarks/results/<name>.json (+ .png)."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Each simulated-cluster benchmark starts and stops its own cluster; run one at a time.
SCRIPTS = ["plan_scaling.py", "step_overhead.py", "startup.py", "strategy_memory.py", "elastic_recovery.py"]


def main() -> int:
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    failed = []
    for script in SCRIPTS:
        print(f"== {script}", flush=True)
        if subprocess.run([sys.executable, str(HERE / script)], env=env).returncode != 0:
            failed.append(script)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
