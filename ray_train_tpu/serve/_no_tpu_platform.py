"""The platform our vLLM plugin names on a TPU host without vllm-torchtpu:
importing it fails with what to do, so that vLLM never falls back to its CPU
platform (or its JAX TPU platform) on a TPU host."""

from ray_train_tpu.serve import platforms as _p

raise RuntimeError(
    "vLLM runs on a TPU host (" + "; ".join(_p.current_evidence()) + ") but vllm-torchtpu, the "
    f"TorchTPU platform, is not installed: {_p.INSTALL_HINT}. To simulate a slice on CPU "
    f"instead, set {_p.C.RAY_TRAIN_TPU_SIMULATE}=1 (every result then says SIMULATED)."
)
