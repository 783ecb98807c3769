"""Every touch of a private Ray, torch, torch_tpu, vLLM or vllm-torchtpu API,
one module per upstream.

- `ray_train_tpu._compat.ray_train`: Ray Train's worker order, device manager,
  backend base class, failed-group clean-up, ``prepare_model`` seam, the GCE
  metadata query, the GCS actor table and ``__ray_call__``;
- `ray_train_tpu._compat.torch`: torch's private PrivateUse1 backend name;
- `ray_train_tpu._compat.torch_tpu`: torch_tpu's ``_internal`` hardware table;
- `ray_train_tpu._compat.ray_llm`: Ray Serve LLM's callback base, OpenAI
  ingress and engine placement;
- `ray_train_tpu._compat.ray_data`: Ray Data's actor start, Ray Data LLM's vLLM
  engine stage, and a driver that leaves vLLM to the engines;
- `ray_train_tpu._compat.vllm`: vLLM's CPU platform and worker, the Ray actor its
  Ray executors start workers in, the CPU backend's eager-mode limit;
- `ray_train_tpu._compat.vllm_torchtpu`: vllm-torchtpu's Ray executor's slice layout.

Each module names the version it was written against (`constants.RAY_VERSION`,
`constants.TORCH_VERSION`, `constants.TORCH_TPU_VERSION`, `constants.VLLM_VERSION`,
`constants.VLLM_TORCHTPU_VERSION`), and
tests/unit/test_compat.py checks that every seam still exists in the installed
version. Nothing outside this package imports a private name of those packages.
"""
