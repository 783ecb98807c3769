"""``python -m ray_train_tpu batch``: prompts from a file through Ray Data LLM's
vLLM engine, one engine per whole TPU slice or, with ``--engine-shape``, one per
piece of a slice (``--plan`` prints the piece the model needs); one JSON line
out per prompt.

    python -m ray_train_tpu batch --model /models/m --topology 4x4 --accelerator-type TPU-V6E \\
        --num-slices 2 --input prompts.jsonl --output out.jsonl --max-tokens 128
    python -m ray_train_tpu batch --model smollm2 --topology 1x1 --accelerator-type TPU-V6E \\
        --num-slices 2 --input prompts.txt --output out.jsonl --simulate

``--input``: JSON lines (one object per prompt; ``--prompt-column``, default
``prompt``) or, for a ``.txt`` file, one prompt per line (column ``text``).
Every output line is the input object plus ``generated_text``,
``generated_token_ids``, ``num_input_tokens``, ``num_generated_tokens`` and
``slice``; the order is not the input's.

Everything is checked before a cluster is started or a slice reserved (bad
input: one line, exit status 2): the files, every input line (a JSON object
with a string in the prompt column), and the options. A run that fails leaves
no output file behind, not even a partial one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import TextIO

ORDER = 95
EXAMPLE = ("python -m ray_train_tpu batch --model smollm2 --topology 1x1 --accelerator-type TPU-V6E "
           "--num-slices 2 --input prompts.txt --output out.jsonl --simulate")


def register(subparsers, add_slice_args) -> None:
    p = subparsers.add_parser("batch", help="batch inference on TPU slices (Ray Data LLM's vLLM engine)")
    p.add_argument("--model", required=True, help="HF model directory or id, or 'smollm2' (packaged)")
    add_slice_args(p)
    p.add_argument("--input", help="prompts: .jsonl (objects) or .txt (one per line); required unless --plan")
    p.add_argument("--output", help="output file (JSON lines); required unless --plan")
    p.add_argument("--prompt-column", help="column of prompt texts (default: prompt; text for .txt)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--tensor-parallel-size", type=int, help="default: sized to the slice and the model")
    p.add_argument("--pipeline-parallel-size", type=int, help="default: the engine's devices / TP")
    p.add_argument("--engine-shape",
                   help='each engine\'s piece of a --topology slice, e.g. "1x1" (one v6e chip), "2x2x1" (one v4 '
                        'host), so that several engines fill each slice (--engines-per-slice, default: as many '
                        "as fit); --plan prints the one the model needs (default: the whole slice)")
    p.add_argument("--engine-kwargs", default="{}", help="more vLLM engine arguments, as JSON")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per batch sent to an engine (default 32)")
    p.add_argument("--reserve-timeout-s", type=float,
                   help="seconds an engine waits for a free multi-host slice head before the job fails "
                        "(default: waits until one is free)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    p.add_argument("--simulate", action="store_true",
                   help="start a SIMULATED cluster with --num-slices slices (CPU) and run on it")
    from ray_train_tpu.serve.cli import add_plan_args

    add_plan_args(p, "batch")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    from ray_train_tpu.serve.cli import _json_object, _model_source, refuse_plan_only_flags, show_plan

    if args.plan:
        return show_plan(args, out, _json_object("--engine-kwargs", args.engine_kwargs))
    refuse_plan_only_flags(args)
    missing = [f for f, v in (("--input", args.input), ("--output", args.output)) if not v]
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join(missing)} (unless --plan)")

    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input!r} is not a file")
    is_text = args.input.endswith(".txt")
    if not (is_text or args.input.endswith((".jsonl", ".json"))):
        raise ValueError(f"--input {args.input!r} must be a .jsonl file of objects or a .txt file of lines")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output {args.output!r}: directory {out_dir!r} does not exist")
    if os.path.abspath(args.output) == os.path.abspath(args.input):
        raise ValueError(f"--output {args.output!r} is the --input file; write the results to another file")
    prompt_column = args.prompt_column or ("text" if is_text else "prompt")
    check_input(args.input, is_text, prompt_column)
    if args.simulate:
        from ray_train_tpu import _environ
        from ray_train_tpu import constants as C

        _environ.update({C.RAY_TRAIN_TPU_SIMULATE: "1"})  # BatchConfig's default, and the engines'
    from ray_train_tpu.serve.batch import BatchConfig

    source, _ = _model_source(args.model)
    config = BatchConfig(
        model=source, topology=args.topology, accelerator_type=args.accelerator_type,
        num_slices=args.num_slices, prompt_column=prompt_column,
        max_tokens=args.max_tokens, temperature=args.temperature,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        engine_kwargs=_json_object("--engine-kwargs", args.engine_kwargs), batch_size=args.batch_size,
        simulate=args.simulate, reserve_timeout_s=args.reserve_timeout_s,
        engine_shape=args.engine_shape, engines_per_slice=args.engines_per_slice,
    )
    from ray_train_tpu.cli import running

    with running("batch inference"):
        if args.simulate:
            from ray_train_tpu.testing import simulated_tpu_cluster

            spec = config.engine.spec
            with simulated_tpu_cluster(spec.topology, spec.accelerator_type, num_slices=args.num_slices):
                return _run(config, args, is_text, out, simulated=True)
        import ray

        ray.init(address=args.address or "auto")
        return _run(config, args, is_text, out, simulated=False)


def _run(config, args, is_text: bool, out: TextIO, simulated: bool) -> int:
    import ray

    from ray_train_tpu.serve.batch import SliceBatchProcessor

    ds = ray.data.read_text(args.input) if is_text else ray.data.read_json(args.input, lines=True)
    t0, rows, tokens = time.monotonic(), 0, 0
    tmp = args.output + ".partial"
    try:
        with SliceBatchProcessor(config) as processor, open(tmp, "w") as f:
            for row in processor(ds).iter_rows():
                f.write(json.dumps(row, default=_plain) + "\n")
                rows += 1
                tokens += row["num_generated_tokens"]
        os.replace(tmp, args.output)  # the output appears whole or not at all
    finally:
        if os.path.exists(tmp):  # a failed (or interrupted) run leaves no partial output
            os.remove(tmp)
    elapsed = time.monotonic() - t0
    note = " (SIMULATED slices, CPU)" if simulated else ""
    out.write(f"{rows} prompts, {tokens} generated tokens in {elapsed:.1f} s ({rows / elapsed:.2f} prompts/s, "
              f"{tokens / elapsed:.1f} tokens/s) on {config.num_slices} x {config.topology} ({config.num_engines} "
              f"engine(s) of {config.engine.num_devices} device(s)){note}; "
              f"wrote {args.output}\n")
    return 0


def check_input(path: str, is_text: bool, prompt_column: str) -> int:
    """Every line of the input, before anything starts: a ``.txt`` file's lines
    are the ``text`` column; a JSON-lines file's are objects with a string in
    `prompt_column`. Returns the number of prompts; ValueError names the line."""
    if is_text and prompt_column != "text":
        raise ValueError(f"--prompt-column {prompt_column!r}: a .txt input has one column, 'text' (one prompt per "
                         "line); leave --prompt-column out, or give a .jsonl file")
    count = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            count += 1
            if is_text:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--input {path!r} line {number} is not JSON ({e}); each line must be one "
                                 "JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"--input {path!r} line {number} is {type(row).__name__}, not a JSON object "
                                 f"with a {prompt_column!r} field")
            if not isinstance(row.get(prompt_column), str):
                found = f"has {type(row[prompt_column]).__name__}" if prompt_column in row else "has no"
                raise ValueError(
                    f"--input {path!r} line {number} {found} {prompt_column!r} text (its fields: {sorted(row)[:8]}); "
                    "give --prompt-column the field that holds the prompt")
    if not count:
        raise ValueError(f"--input {path!r} has no prompts; give at least one line")
    return count


def _plain(value):
    tolist = getattr(value, "tolist", None)  # numpy values from Arrow
    if tolist is None:
        raise TypeError(f"cannot write {type(value).__name__} as JSON")
    return tolist()
