"""`_validate`: one rule, one message (field, value, rule, fix), and every public
constructor refusing bad input at construction, by name."""

import math

import pytest

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig
from ray_train_tpu import _validate as V
from ray_train_tpu.topology import MAX_TOPOLOGY_LENGTH, Topology


@pytest.mark.parametrize("call, message", [
    (lambda: V.check_int("Owner", "n", 0, min=1, max=4, fix="pass n=1"),
     "Owner(n=0) must be an integer in 1..4, got 0; pass n=1"),
    (lambda: V.check_int("", "n", True, min=1), "n must be an integer >= 1, got True"),
    (lambda: V.check_seconds("Owner", "timeout_s", math.inf),
     "Owner(timeout_s=inf) must be a finite number of seconds in (0, 604800], got inf; e.g. timeout_s=1800"),
    (lambda: V.check_port("", "base_port", 65534, span=4),
     "base_port must be an integer in 1..65532 (so that base_port..base_port+3 are ports), got 65534"),
    (lambda: V.check_num_slices("X", 10**9), "X(num_slices=1000000000) must be an integer in 1..256, got "
                                               "1000000000; at most 256 (the largest reported Multislice"),
])
def test_one_message_names_field_value_rule_and_fix(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(message), str(e.value)


def test_accepted_values_come_back():
    assert V.check_int("", "n", 3, min=1) == 3 and V.check_seconds("", "t", 0.5) == 0.5
    assert V.check_port("", "p", 65535) == 65535 and V.check_bool("", "b", False) is False
    assert V.check_env("", "e", {"A_1": "x"}) == {"A_1": "x"}
    assert V.check_resources("", "r", {"CPU": 0, "memory": 1.5}) == {"CPU": 0, "memory": 1.5}


@pytest.mark.parametrize("value, error, detail", [
    ("A=1", TypeError, "must be a dict of environment variable names"),
    ({"1A": "x"}, ValueError, "'1A' is not a valid name"),
    ({"A B": "x"}, ValueError, "'A B' is not a valid name"),
    ({"A": "x\0y"}, ValueError, "has a NUL"),
    ({"A": 1}, TypeError, "'A': 1 is not str: str"),
])
def test_extra_env_must_be_what_the_os_accepts(value, error, detail):
    with pytest.raises(error, match="TPUTorchConfig\\(extra_env=") as e:
        TPUTorchConfig(extra_env=value)
    assert detail in str(e.value)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(timeout_s=float("nan")), "TPUTorchConfig(timeout_s=nan) must be a finite number of seconds"),
    (dict(rendezvous_timeout_s=1e12), "rendezvous_timeout_s=1000000000000.0) must be a finite number of seconds"),
    (dict(rendezvous_timeout_s="60"), "rendezvous_timeout_s='60') must be a finite number"),
    (dict(backend="mpi"), "TPUTorchConfig(backend='mpi') must be one of 'auto', 'tpu_dist', 'gloo', 'nccl'"),
    (dict(num_slices="2"), "TPUTorchConfig(num_slices='2') must be an integer in 1..256"),
    (dict(num_slices=0), "TPUTorchConfig(num_slices=0) must be an integer in 1..256"),
    (dict(master_port=0), "TPUTorchConfig(master_port=0) must be an integer in 1..65535"),
    (dict(base_port=65530), "TPUTorchConfig(base_port=65530) must be an integer in 1..65528"),
])
def test_torch_config_refuses_at_construction(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        TPUTorchConfig(**kwargs)
    assert fragment in str(e.value)


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(num_slices=10**6), ValueError, "TPUScalingConfig(num_slices=1000000) must be an integer in 1..256"),
    (dict(num_slices=2.0), ValueError, "TPUScalingConfig(num_slices=2.0) must be an integer"),
    (dict(resources_per_worker=4), TypeError, "resources_per_worker=4) must be a dict of resource names"),
    (dict(resources_per_worker={"CPU": -1}), ValueError, "'CPU': -1 is negative or not finite"),
    (dict(resources_per_worker={"CPU": float("inf")}), ValueError, "'CPU': inf is negative or not finite"),
    (dict(resources_per_worker={"CPU": "2"}), TypeError, "'CPU': '2' is not a number"),
    (dict(topology="4" * 5000), ValueError, f"the longest real slice name has fewer than {MAX_TOPOLOGY_LENGTH}"),
])
def test_scaling_config_refuses_at_construction(kwargs, error, fragment):
    args = dict(topology="4x4", accelerator_type="TPU-V6E") | kwargs
    with pytest.raises(error) as e:
        TPUScalingConfig(**args)
    assert fragment in str(e.value)


def test_every_bound_that_protects_the_machine_names_its_reason():
    with pytest.raises(ValueError, match="199 slices"):
        V.check_num_slices("", 257)
    with pytest.raises(ValueError, match="raylet process"):
        from ray_train_tpu.testing import simulated_tpu_cluster

        with simulated_tpu_cluster("4x4", "TPU-V6E", num_slices=17):
            pass  # pragma: no cover  (refused before anything starts)
    with pytest.raises(ValueError, match="characters long"):
        Topology.parse("2x" * 40 + "2", "TPU-V4")


def test_cli_refuses_huge_slices_at_once():
    import io

    from ray_train_tpu.cli import main

    for command in ("plan", "kuberay"):
        err = io.StringIO()
        argv = [command, "--topology", "8x16x16", "--accelerator-type", "TPU-V7X", "--num-slices", "100000"]
        assert main(argv, out=io.StringIO(), err=err) == 2
        assert "num_slices must be an integer in 1..256, got 100000" in err.getvalue()
