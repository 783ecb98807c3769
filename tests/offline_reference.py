"""A Python script in a process of its own, started at once and read when needed
(the serving tests' offline references: they run while the cluster starts). The
script prints its answer as one ``RESULT <json>`` line."""

import json
import os
import subprocess
import sys


class OfflineReference:
    """``code`` run with ``arg`` (as JSON) in a process of its own, simulated;
    `result` waits for it and returns its ``RESULT`` line's JSON."""

    def __init__(self, code: str, arg, log_dir):
        env = {**os.environ, "RAY_TRAIN_TPU_SIMULATE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        self.out, self.err = open(log_dir / "stdout", "w+"), open(log_dir / "stderr", "w+")
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(arg)], stdout=self.out,
                                     stderr=self.err, text=True, env=env)
        self._result = None

    def result(self):
        if self._result is None:
            self.proc.wait(timeout=900)
            self.out.seek(0)
            self.err.seek(0)
            lines = [line for line in self.out.read().splitlines() if line.startswith("RESULT ")]
            assert self.proc.returncode == 0 and lines, self.err.read()[-3000:]
            self._result = json.loads(lines[-1][len("RESULT "):])
        return self._result

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()
