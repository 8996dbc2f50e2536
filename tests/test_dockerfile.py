"""The Dockerfile, checked without a Docker engine: its shape, then its own commands.

No Docker runs on the development machines, so the image is verified the other way
round: the Dockerfile is parsed, and the exact RUN commands of both stages and the exact
ENTRYPOINT are run here - the wheel build in a copy of the build context, the install
into a fresh virtual environment, the service started from there (not from the source
tree) until ``GET /healthz`` answers. Only the paths differ: ``/wheels`` and the build
stage's WORKDIR become temporary directories, and ``pip``/``kvindex`` resolve to the
environment being built, as they do in the image.
"""

from __future__ import annotations

import fnmatch
import functools
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvindex.api.testing import ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS_DIR = "/opt/kvindex/tokenizers/"  # where the image holds each model's tokenizer


@dataclass
class Stage:
    image: str
    name: str | None
    args: dict[str, str] = field(default_factory=dict)
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.steps if ins == instruction]


def logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return lines


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def parse(text: str) -> list[Stage]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            target = stages[-1].args if stages else global_args
            target[name] = default.strip('"') or global_args.get(name, "")
        elif instruction == "FROM":
            words = substitute(rest, global_args).split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        else:
            assert stages, f"{instruction} before FROM"
            stages[-1].steps.append((instruction, rest))
    return stages


def run_command(rest: str, args: dict[str, str]) -> tuple[list[str], str]:
    """A RUN's ``--mount=`` flags and its shell command, ARGs expanded."""
    flags = []
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
    return flags, substitute(rest.strip(), args)


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for rest in stage.all("ENV"):
        for word in shlex.split(rest):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def dockerignore_allows(path: str) -> bool:
    """Whether .dockerignore lets ``path`` into the build context (last match wins)."""
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse((ROOT / "Dockerfile").read_text())


def named(stages: list[Stage], name: str) -> Stage:
    (stage,) = [s for s in stages if s.name == name]
    return stage


def build_and_final(stages: list[Stage]) -> tuple[Stage, Stage]:
    """The stage that builds the wheels and the image itself (the last stage)."""
    return named(stages, "build"), stages[-1]


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    out = []
    for rest in stage.all("COPY"):
        words = rest.split()
        assert not any(w.startswith("--from") for w in words)
        out.append((words[:-1], words[-1]))
    return out


# -- shape ---------------------------------------------------------------------------------


def test_build_and_final_stage_slim_non_root_exec_entrypoint(stages: list[Stage]) -> None:
    build, final = build_and_final(stages)
    assert build.name and "slim" in final.image
    # The build stage compiles the table kernels: the full image of the same Python and
    # Debian release (it has gcc), so the wheel it builds installs on the slim one.
    assert build.image == final.image.replace("-slim", "")
    user = final.all("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric, so runAsNonRoot can verify it"
    exposed = {int(p) for rest in final.all("EXPOSE") for p in rest.split()}
    assert {8080, 5557} <= exposed
    entrypoint = json.loads(final.all("ENTRYPOINT")[-1])
    assert entrypoint == ["kvindex", "serve"]
    # kvindex listens on 127.0.0.1 unless told; the image must serve its EXPOSEd port.
    assert env_of(final)["KVINDEX_LISTEN"] == "0.0.0.0:8080"
    # The image gets only the install and the tokenizer files.
    assert final.all("COPY") == [f"--from=tokenizers / {TOKENIZERS_DIR}"] and not final.all("ADD")
    for rest in final.all("RUN"):
        flags, command = run_command(rest, final.args)
        assert not re.search(r"apt-get|apk |gcc|build-essential|\bgit\b", command)
        assert "--no-index" in command, "the final stage must not download anything"
        assert f"--mount=type=bind,from={build.name},source=/wheels,target=/wheels" in flags


def test_build_stage_copies_every_package_and_the_context_allows_it(stages) -> None:
    build = named(stages, "build")
    sources = [s.rstrip("/") for srcs, _ in copies(build) for s in srcs]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = set(project["tool"]["setuptools"]["package-dir"].values())
    needed |= {"pyproject.toml", "setup.py", project["project"]["readme"]}
    needed |= set(project["project"]["license-files"])  # the build reads them
    assert needed <= set(sources), f"not copied: {needed - set(sources)}"
    for source in sources:
        assert (ROOT / source).exists(), source
        assert dockerignore_allows(source), f".dockerignore excludes {source}"
    for unwanted in ("tests", "bench", "deploy", ".git", ".venv", "kvindex.egg-info"):
        assert not dockerignore_allows(unwanted), f".dockerignore lets {unwanted} in"


def image_models(stages: list[Stage]) -> list[str]:
    """The models whose tokenizer the default image holds (TOKENIZER_MODELS, no @rev)."""
    models = named(stages, "tokenizer-download").args["TOKENIZER_MODELS"].split()
    return [entry.partition("@")[0] for entry in models]


def test_the_image_can_tokenize_and_the_manifests_name_its_tokenizers(stages) -> None:
    """Before, the image had no tokenizer support and the ConfigMap no tokenizer: every
    gateway request was routed by load alone (fallback_tokenizer_unavailable)."""
    yaml = pytest.importorskip("yaml")
    build, final = build_and_final(stages)
    for stage in (build, final):
        assert "tokenize" in stage.args["EXTRAS"].split(","), stage.name
    (install,) = final.all("RUN")
    assert '"kvindex[${EXTRAS}]"' in install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]["tokenize"]
    assert {re.split(r"[<>=\[]", d)[0] for d in extras} >= {"tokenizers", "jinja2"}
    # The tokenizers stage is what the download stage wrote, or --build-context tokenizers=DIR.
    tokenizers = named(stages, "tokenizers")
    assert tokenizers.image == "scratch"
    assert tokenizers.steps == [("COPY", "--from=tokenizer-download /tokenizers/ /")]
    assert named(stages, "tokenizer-download").all("WORKDIR") == ["/tokenizers"]

    # The base ConfigMap's models each name their folder in the image.
    configmap = (ROOT / "deploy/base/configmap.yaml").read_text()
    config = yaml.safe_load(yaml.safe_load(configmap)["data"]["models.yaml"])
    assert config["models"]
    for model, entry in config["models"].items():
        assert model in image_models(stages), f"the image has no tokenizer for {model}"
        assert entry.get("tokenizer") == TOKENIZERS_DIR + model, model


def test_the_tokenizer_stage_fetches_each_models_files_from_the_hub(stages, tmp_path) -> None:
    """The download stage's RUN, verbatim but for the Hub's address: a loopback server
    laid out as the Hub's ``<model>/resolve/<revision>/<file>``."""
    from kvindex.scoring.prompt.tokenize import TokenizerRegistry
    from tests.test_api import make_tokenizer

    if not shutil.which("curl"):
        pytest.skip("no curl here (the build image has it)")
    hub = tmp_path / "hub"
    served = {"acme/one": "main", "acme/two": "0123abcd"}
    for model, revision in served.items():
        make_tokenizer(hub / model / "resolve" / revision)
    (hub / "acme/one/resolve/main/chat_template.jinja").write_text("{{ messages }}")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(hub))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        download = named(stages, "tokenizer-download")
        args = {
            **download.args,
            "TOKENIZER_MODELS": "acme/one acme/two@0123abcd",
            "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        }
        (step,) = download.all("RUN")
        flags, _ = run_command(step, args)
        assert flags == ["--mount=type=secret,id=hf_token"]  # optional: gated models only
        out = tmp_path / "tokenizers"  # the stage's WORKDIR
        out.mkdir()

        def run(models: str) -> subprocess.CompletedProcess[str]:
            _, command = run_command(step, {**args, "TOKENIZER_MODELS": models})
            env = {**clean_env(Path(sys.executable).parent), **args, "TOKENIZER_MODELS": models}
            return subprocess.run(
                ["sh", "-c", command], cwd=out, env=env, capture_output=True, text=True, timeout=60
            )

        done = run(args["TOKENIZER_MODELS"])
        assert done.returncode == 0, done.stderr
        # A model id the Hub does not have fails the build, not the first request.
        assert run("acme/misspelt").returncode != 0
        shutil.rmtree(out / "acme/misspelt")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    found = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert found == [
        "acme/one/chat_template.jinja", "acme/one/tokenizer.json",
        "acme/one/tokenizer_config.json",
        "acme/two/tokenizer.json", "acme/two/tokenizer_config.json",
    ]  # fmt: skip
    registry = TokenizerRegistry({m: str(out / m) for m in served})
    assert registry.unusable(list(served)) == {}


# -- the exact commands --------------------------------------------------------------------


def shell(command: str, cwd: Path, env: dict[str, str], timeout: float) -> None:
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def clean_env(bin_dir: Path) -> dict[str, str]:
    """The caller's environment without anything that points Python at this checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("KVINDEX_")
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_dockerfile_commands_build_install_and_start(stages, tmp_path: Path) -> None:
    build, final = build_and_final(stages)
    wheels = tmp_path / "wheels"
    workdir = tmp_path / "src"  # the build stage's WORKDIR
    assert build.all("WORKDIR") == ["/src"]
    for sources, dest in copies(build):
        # Docker: a directory source copies its contents into dest; files land in dest/.
        target = workdir / dest
        for source in sources:
            if (ROOT / source).is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(ROOT / source, target, ignore=ignore, dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target / Path(source).name)

    # Stage 1, verbatim but for the paths: the wheels of kvindex and its dependencies.
    (build_run,) = build.all("RUN")
    _, command = run_command(build_run, build.args)
    build_env = clean_env(Path(sys.executable).parent)
    shell(command.replace("/wheels", str(wheels)), workdir, build_env, 600)
    assert list(wheels.glob("kvindex-*.whl"))

    # Stage 2: a fresh environment stands for the image's Python.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (final_run,) = final.all("RUN")
    _, command = run_command(final_run, final.args)
    env = {**clean_env(venv / "bin"), **env_of(final)}
    shell(command.replace("/wheels", str(wheels)), tmp_path, env, 600)

    # The image's tokenizer folders, as the tokenizers stage (or --build-context
    # tokenizers=DIR) gives them, and the base ConfigMap's config pointing there.
    from tests.test_api import make_tokenizer

    yaml = pytest.importorskip("yaml")
    image_root = tmp_path / "image"
    for model in image_models(stages):
        make_tokenizer(image_root / TOKENIZERS_DIR.strip("/") / model)
    configmap = yaml.safe_load((ROOT / "deploy/base/configmap.yaml").read_text())
    models_yaml = configmap["data"]["models.yaml"].replace(
        TOKENIZERS_DIR, f"{image_root}{TOKENIZERS_DIR}"
    )
    (tmp_path / "models.yaml").write_text(models_yaml)
    (model, *_) = yaml.safe_load(models_yaml)["models"]

    # Start it exactly as the image does (listening on loopback only, not 0.0.0.0), as
    # the gateway overlay runs it: ready only once the configured model's tokenizer loads.
    port = free_port()
    env["KVINDEX_LISTEN"] = f"127.0.0.1:{port}"
    env["KVINDEX_MODEL_CONFIG"] = str(tmp_path / "models.yaml")
    env["KVINDEX_GATEWAY_ENABLED"] = "true"
    env["KVINDEX_ZMQ_BIND"] = f"tcp://127.0.0.1:{free_port()}"
    entrypoint = json.loads(final.all("ENTRYPOINT")[-1])
    with ServeProcess(
        port=port, command=entrypoint, listen_flag=False, env=env, cwd=tmp_path
    ) as server:
        server.wait_ready(60.0, path="/healthz")
        answer = httpx.get(f"{server.url}/healthz", timeout=5)
        assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        ready = httpx.get(f"{server.url}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text
        scored = httpx.post(
            f"{server.url}/score", json={"model": model, "prompt": "hello world"}, timeout=5
        )
        assert scored.status_code == 200 and scored.json()["prompt_tokens"] > 0, scored.text
        module = subprocess.run(
            [str(venv / "bin/python"), "-c", "import kvindex.api; print(kvindex.api.__file__)"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert str(venv) in module, f"kvindex was imported from {module}, not the install"
        if shutil.which("cc") or shutil.which("gcc"):  # as in the build stage's image
            version = subprocess.run(
                ["kvindex", "--version"], env=env, capture_output=True, text=True, check=True
            ).stdout
            # the build stage's image has gcc and libssl-dev: every extension builds
            assert (
                "(compiled table, compiled hashing, compiled payloads, compiled receive, "
                "compiled token_ids, compiled route loop)" in version
            ), version
