"""Our checkpoint's model tensor names -> the base Hugging Face model's tensor names.

A model trained through `prepare_model` is saved under the names of
``get_model_state_dict``, which already drops DDP's ``module.``, FSDP's and
activation checkpointing's wrapper names and ``torch.compile``'s ``_orig_mod.``:
a Hugging Face model trained as it is keeps its Hugging Face names. What is
left to map:

- a Hugging Face model held as an attribute of the user's module
  (``self.lm = AutoModelForCausalLM...`` -> ``lm.model.layers.0...``): one common
  prefix, found from the base model's names, is dropped;
- tied weights: the base model stores the input embedding once and leaves out
  the output projection (``lm_head.weight``) its config ties to it
  (``tie_word_embeddings``); the checkpoint holds both names (one tensor), and
  the tied one is not exported.

Anything else (a tensor the base model does not have, one it has that the
checkpoint lacks, another shape) is a mismatch, reported by name.
"""

from __future__ import annotations

from typing import Sequence

# Wrapper path components that upstream state dicts may still carry (a module
# saved with plain ``state_dict()``, or an older torch).
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
# Output projections that Hugging Face models tie to the input embedding.
_TIED_OUTPUT = ("lm_head.weight",)


def _unwrapped(name: str) -> str:
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":  # DDP's wrapper is always the outermost
        parts = parts[1:]
    return ".".join(parts)


def _prefixes(ours: Sequence[str], anchor: str) -> list[str]:
    """Prefixes ``p`` ("" or ending in ".") with ``p + anchor`` among our names, shortest first."""
    found = {n[: len(n) - len(anchor)] for n in ours if n == anchor or n.endswith("." + anchor)}
    return sorted(found, key=len)


def hf_names(ours: dict, base: dict, *, tied: bool) -> dict:
    """``{our name: Hugging Face name}`` for every tensor the export writes.

    ``ours`` and ``base`` map names to shapes (tuples); ``tied`` is the base
    config's ``tie_word_embeddings``. Raises ``ValueError`` naming up to three
    mismatches (and how many more) when the checkpoint is not of the base model.

    Example:
        >>> hf_names({"lm.w": (2,), "lm.lm_head.weight": (3, 2)}, {"w": (2,)}, tied=True)
        {'lm.w': 'w'}
    """
    plain = {}
    for name in ours:
        plain.setdefault(_unwrapped(name), name)
    anchor = min(base, key=lambda n: (n.count("."), n)) if base else None
    prefix = ""
    for p in _prefixes(list(plain), anchor) if anchor else []:
        if all(p + b in plain for b in base):
            prefix = p
            break
    mapping, problems = {}, []
    for name in sorted(plain):
        hf = name[len(prefix):] if name.startswith(prefix) else None
        if hf in base:
            mapping[plain[name]] = hf
        elif not (tied and hf in _TIED_OUTPUT):
            problems.append(f"{plain[name]!r} is in the checkpoint but not in the base model")
    problems += [f"{b!r} is in the base model but not in the checkpoint"
                 for b in sorted(set(base) - set(mapping.values()))]
    problems += [f"{ours_name!r} is {list(ours[ours_name])} in the checkpoint and {list(base[hf])} in the base model"
                 for ours_name, hf in sorted(mapping.items()) if tuple(ours[ours_name]) != tuple(base[hf])]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        where = f" (names compared after dropping the prefix {prefix!r})" if prefix else ""
        raise ValueError("; ".join(problems[:3]) + more + where)
    return mapping
