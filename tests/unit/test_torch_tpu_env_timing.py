"""When torch_tpu reads its environment: lazily, on first use, and only once.

This is why the backend sets every worker's variables in on_start, before the
training function (and so before any device or process-group use), and why a
value changed after first use would be ignored.
"""

import os
import subprocess
import sys

import torch_tpu  # noqa: F401  (the [tpu] extra, which make test installs: never skipped)

_CODE = """
import os
os.environ["TORCH_TPU_TOPOLOGY"] = "before-import"
import torch  # autoloads torch_tpu (TORCH_DEVICE_BACKEND_AUTOLOAD=1 here)
import sys
assert "torch_tpu" in sys.modules, "torch_tpu was not autoloaded"
from torch_tpu._internal import env
names = ["TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID",
         "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TPU_WORKER_HOSTNAMES"]
for n in names:
    os.environ[n] = "set-after-import"
first = {n: env.get_str_env_once(n) for n in names}
for n in names:
    os.environ[n] = "changed-after-first-read"
second = {n: env.get_str_env_once(n) for n in names}
print("FIRST", sorted(set(first.values())))
print("SECOND", sorted(set(second.values())))
"""


def test_import_reads_nothing_and_first_read_is_final():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_TPU_", "MASTER_", "NODE_RANK"))}
    env.update({"TPU_SKIP_MDS_QUERY": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    out = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True,
                         timeout=240, check=True).stdout
    # nothing was read at import: values set after the import are the ones seen
    assert "FIRST ['set-after-import']" in out
    # and the first read is memoised: later changes are never seen
    assert "SECOND ['set-after-import']" in out
