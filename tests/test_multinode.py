"""Multi-node placement on one machine: a `ray.cluster_utils.Cluster` whose head has no CPUs or GPUs
(it takes no replicas, like cluster.yaml's) and two worker nodes of two fake GPUs each. The ranks
run the CPU backend (gloo), but each rank's bundle also reserves a GPU (`rank_resources`), so a TP=2
replica fills one node: its group is packed there, the two replicas land on the two worker nodes,
and both serve the HTTP traffic sent with the official openai client."""

import concurrent.futures
import time

import openai
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from serve_app import run_app, stop_app
from tiny_models import tiny_llama

from deployments.config import ServeConfig
from deployments.llm_server import llm_server_options

GPUS_PER_NODE = 2
CPUS_PER_NODE = 5  # room for both replicas' CPU bundles (2 x 2.01): only the GPUs keep them apart


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(tiny_llama(tmp_path_factory.mktemp("multinode") / "tiny", layers=2))
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False},
    )
    workers = [c.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    cfg = ServeConfig(
        engine={
            "model": model,
            "drafter": "none",
            "tp": 2,
            "max_batch_size": 8,
            "max_model_len": 128,
            "max_num_batched_tokens": 256,
            "device": "cpu",
        },
        served_model_name="tiny",
        num_replicas=2,
        rank_resources={"CPU": 1, "GPU": 1},
    )
    url = run_app(cfg, proxy_location="HeadOnly")
    yield {
        "url": url,
        "head": c.head_node.node_id,
        "workers": {n.node_id for n in workers},
        "handle": serve.get_deployment_handle("LLMServer", app_name="eagleserve"),
    }
    stop_app()
    c.shutdown()


def _replicas(handle, n=2, timeout=60) -> list[dict]:
    """replica_info of n distinct replicas (each call goes to one replica the router picks)."""
    deadline, seen = time.monotonic() + timeout, {}
    while time.monotonic() < deadline and len(seen) < n:
        info = handle.replica_info.remote().result(timeout_s=30)
        seen[info["pid"]] = info
    assert len(seen) == n, f"only {len(seen)} of {n} replicas answered"
    return sorted(seen.values(), key=lambda i: i["pid"])


def test_rank_bundles_reserve_the_fake_gpus():
    cfg = ServeConfig(engine={"device": "cpu", "tp": 2}, rank_resources={"CPU": 1, "GPU": 1})
    assert llm_server_options(cfg)["placement_group_bundles"] == [
        {"CPU": 0.01},
        {"CPU": 1, "GPU": 1},
        {"CPU": 1, "GPU": 1},
    ]
    with pytest.raises(ValueError, match="at least 1 CPU"):
        llm_server_options(ServeConfig(engine={"device": "cpu"}, rank_resources={"GPU": 1}))


def test_each_group_packed_on_its_own_worker_node(cluster):
    replicas = _replicas(cluster["handle"])
    nodes = [r["node_id"] for r in replicas]
    for r in replicas:
        assert [w["rank"] for w in r["workers"]] == [0, 1]
        # STRICT_PACK: replica and ranks
        assert {w["node_id"] for w in r["workers"]} == {r["node_id"]}, r
    assert len(set(nodes)) == 2 and set(nodes) == cluster["workers"]
    assert cluster["head"] not in nodes
    assert ray.available_resources().get("GPU", 0) == 0  # the 2 x 2 fake GPUs are the groups'


def test_both_replicas_serve_http_traffic(cluster):
    before = {r["pid"]: r["num_requests"] for r in _replicas(cluster["handle"])}
    client = openai.OpenAI(
        base_url=f"{cluster['url']}/v1", api_key="unused", max_retries=0, timeout=120
    )

    def ask(i):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=8,
            temperature=0,
        )
        return r.choices[0].message.content, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(24)))
    # both replicas load the same weights: same greedy text
    assert len(set(answers)) == 1 and answers[0][1] == 8
    served = {r["pid"]: r["num_requests"] - before[r["pid"]] for r in _replicas(cluster["handle"])}
    assert sum(served.values()) == 24 and all(n > 0 for n in served.values()), served
