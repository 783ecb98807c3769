"""``kuberay``: a KubeRay RayCluster or RayJob manifest for GKE TPU slices (`ray_train_tpu.kuberay`)."""

from __future__ import annotations

import argparse
from typing import Callable, TextIO

from ray_train_tpu.kuberay import DEFAULT_IMAGE, FORMATS, KINDS, build_manifest, format_manifest
from ray_train_tpu.topology import Topology

ORDER = 10
EXAMPLE = 'python -m ray_train_tpu kuberay --topology 4x4 --accelerator-type TPU-V6E --num-slices 2 --kind RayJob --entrypoint "python train.py"'


def _kuberay(args: argparse.Namespace, out: TextIO) -> int:
    topology = Topology.parse(args.topology, args.accelerator_type)
    manifest = build_manifest(
        topology,
        num_slices=args.num_slices,
        kind=args.kind,
        image=args.image,
        name=args.name,
        entrypoint=args.entrypoint,
    )
    out.write(format_manifest(manifest, args.format))
    return 0


def register(subparsers, add_slice_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``kuberay`` to ``python -m ray_train_tpu``."""
    p = subparsers.add_parser("kuberay", help="print a KubeRay RayCluster or RayJob manifest for GKE TPU slices")
    add_slice_args(p)
    p.add_argument("--kind", choices=KINDS, default="RayCluster", help="default RayCluster")
    p.add_argument("--name", help="metadata.name (default ray-train-<pod type>)")
    p.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help=f"image with torch, torch-tpu and ray_train_tpu (default {DEFAULT_IMAGE}, a placeholder without them)",
    )
    p.add_argument("--entrypoint", help="command the RayJob runs, e.g. 'python train.py' (RayJob only)")
    p.add_argument("--format", choices=FORMATS, default="yaml", help="manifest format (default yaml)")
    p.set_defaults(func=_kuberay)
