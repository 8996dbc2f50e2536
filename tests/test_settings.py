"""The settings tree (issue 14): one nested msgspec tree, its defaults written once,
decoded from flags over ``KVINDEX_*`` variables over the config file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve import cli
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings import SECTIONS, Settings
from kvindex.api.serve.settings_derived import ConfigError, discovery_config
from kvindex.api.serve.settings_sources import LEAVES, decode_settings, from_flags
from kvindex.api.testing import eventually, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.scoring.route.cost import CostWeights
from kvindex.scoring.scorer import TierWeights


def config_file(tmp_path: Path, tree: dict) -> str:
    path = tmp_path / "kvindex.json"
    path.write_text(json.dumps(tree))
    return str(path)


def serve_settings(argv: list[str], environ: dict[str, str]) -> Settings:
    return cli._settings_from(cli.build_parser().parse_args(["serve", *argv]), environ)


def test_the_tree_has_the_sections_the_issue_names() -> None:
    settings = Settings()
    assert {"http", "events", "index", "k8s", "scoring"} <= set(SECTIONS)
    assert settings.http.max_pods == 4096 and settings.events.stream_queue == 32_768
    assert settings.index.hash_algo.value == "sha256" and settings.k8s.mode == "connect"


def test_flag_beats_variable_beats_file_beats_default(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"http": {"max_pods": 10}, "k8s": {"namespace": ["serving"]}})
    flag, env = ["--max-pods", "30"], {"KVINDEX_MAX_PODS": "20"}
    assert serve_settings(["--model-config", path, *flag], env).http.max_pods == 30
    assert serve_settings(["--model-config", path], env).http.max_pods == 20
    assert serve_settings(["--model-config", path], {}).http.max_pods == 10
    assert serve_settings([], {}).http.max_pods == 4096
    # The file's path itself may come from the environment.
    settings = serve_settings([], {"KVINDEX_MODEL_CONFIG": path})
    assert discovery_config(settings).namespaces == ("serving",)


def test_tier_weights_have_one_definition(tmp_path: Path) -> None:
    """The defaults are scoring's own type; the file overrides a field and keeps the rest."""
    assert Settings().scoring.tier_weights == TierWeights()
    assert Settings().scoring.route_weights == CostWeights()
    path = config_file(tmp_path, {"scoring": {"tier_weights": {"cpu": 0.6}}})
    service = Service(from_flags(model_config=path))
    try:
        weights = service.scorer._weights
        assert isinstance(weights, TierWeights)
        assert (weights.gpu, weights.cpu, weights.storage) == (1.0, 0.6, TierWeights().storage)
    finally:
        service.stop()


def test_the_first_spelling_of_the_weights_still_reads(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"tier_weights": {"storage": 0.25}, "route_weights": {"kv": 3}})
    scoring = from_flags(model_config=path).scoring
    assert scoring.tier_weights.storage == 0.25 and scoring.route_weights.kv == 3.0


def test_file_mistakes_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_podz"):
        from_flags(model_config=config_file(tmp_path, {"http": {"max_podz": 1}}))
    with pytest.raises(ConfigError, match="--stream-queue or KVINDEX_STREAM_QUEUE"):
        from_flags(model_config=config_file(tmp_path, {"events": {"stream_queue": 0}}))
    with pytest.raises(ConfigError, match="route_weights"):
        from_flags(model_config=config_file(tmp_path, {"scoring": {"route_weights": {"kv": -1}}}))
    with pytest.raises(ConfigError, match="mapping"):
        from_flags(model_config=config_file(tmp_path, [1, 2]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a number"):
        decode_settings({}, {"KVINDEX_K8S_GRACE_SECONDS": "soon"})
    with pytest.raises(ConfigError, match="no such setting"):
        from_flags(max_podz=1)


def test_help_shows_the_defaults_of_the_tree() -> None:
    text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    flat = " ".join(text.split())
    assert "largest HTTP request body (default 16777216)" in flat
    assert "--k8s-selector" in flat and "(default kvindex.io/enabled=true)" in flat
    assert "--tier-weights" not in flat  # a table: the config file only


def test_every_leaf_has_a_description_and_a_unique_flag() -> None:
    flags = [leaf.flag for leaf in LEAVES.values()]
    assert len(flags) == len(set(flags))
    for leaf in LEAVES.values():
        assert leaf.meta.description, leaf.dest


def test_the_readmes_flag_table_states_the_trees_defaults() -> None:
    """The docs' configuration tables repeat each default for readers; they must say
    what the tree says (the one place the defaults are written). The full table is
    generated (docs/configuration-reference.md); hand-written ones (docs/redis.md) too
    must agree."""
    root = Path(__file__).resolve().parents[1]
    readme = "\n".join(
        page.read_text(encoding="utf-8")
        for page in [root / "README.md", *root.glob("docs/*.md")]
        if page.name != "configuration-reference.md"  # generated from the tree itself
    )
    by_flag = {leaf.flag: leaf for leaf in LEAVES.values()}
    checked = 0
    for flag, default in re.findall(r"^\| `(--[a-z0-9-]+)[^`]*` \| `([^`]+)`", readme, re.M):
        leaf = by_flag.get(flag)
        if leaf is None or leaf.default is None:
            continue
        value = leaf.default.value if hasattr(leaf.default, "value") else leaf.default
        if isinstance(value, int | float):
            assert float(default) == float(value), (flag, default, value)
        else:
            assert default == str(value), (flag, default, value)
        checked += 1
    assert checked >= 4  # the Redis settings table (docs/redis.md)


def test_load_staleness_is_three_intervals_unless_set() -> None:
    service = Service(from_flags(load_interval=0.5))
    try:
        assert service.load.stale_after_s == 1.5
    finally:
        service.stop()
    service = Service(from_flags(load_interval=0.5, load_stale_after=20.0))
    try:
        assert service.load.stale_after_s == 20.0
    finally:
        service.stop()
    with pytest.raises(ConfigError, match="--load-stale-after"):
        Service(from_flags(load_stale_after=-1.0))


def test_catch_up_on_first_contact_is_a_setting_that_reaches_the_subscriber(
    tmp_path: Path,
) -> None:
    """Issue 27: the README documents turning ``catch_up_on_first_contact`` off; the
    file key, the variable and the flag all set it, and the subscriber gets it."""
    assert Settings().events.catch_up_on_first_contact is True
    path = config_file(tmp_path, {"events": {"catch_up_on_first_contact": False}})
    assert from_flags(model_config=path).events.catch_up_on_first_contact is False
    env = {"KVINDEX_CATCH_UP_ON_FIRST_CONTACT": "false"}
    assert serve_settings([], env).events.catch_up_on_first_contact is False
    assert (
        serve_settings(["--no-catch-up-on-first-contact"], {}).events.catch_up_on_first_contact
        is False
    )
    on = serve_settings(["--catch-up-on-first-contact"], env)  # a flag beats the variable
    assert on.events.catch_up_on_first_contact is True
    with pytest.raises(ConfigError, match="KVINDEX_CATCH_UP_ON_FIRST_CONTACT"):
        decode_settings({}, {"KVINDEX_CATCH_UP_ON_FIRST_CONTACT": "maybe"})
    for wanted in (True, False):
        service = Service(from_flags(catch_up_on_first_contact=wanted))
        try:
            assert service.subscriber._config.catch_up_on_first_contact is wanted
        finally:
            service.stop()


@pytest.mark.parametrize(("catch_up", "state"), [(True, "incomplete"), (False, "live")])
def test_without_catch_up_a_late_joined_stream_is_live(catch_up: bool, state: str) -> None:
    """A stream first heard past seq 0 with nothing to replay from is ``incomplete``,
    unless catch-up is off: then kvindex applies from there and claims no history."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = from_flags(zmq_bind=[endpoint], model="m", catch_up_on_first_contact=catch_up)
    service = Service(settings)
    pub = EnginePublisher(endpoint, topic="kv@127.0.0.1:8000@m", bind=False)
    try:
        with TestClient(create_app(service)):
            assert pub.wait_for_subscribers(1, 5.0)
            tokens = list(range(16))
            stored = BlockStored(BlockHasher(HashConfig()).keys(tokens), None, tokens, 16)
            pub.publish([stored], send=False)  # kvindex joined after seq 0
            pub.publish([stored])

            def seen() -> bool:
                streams = service.subscriber.streams()
                return bool(streams) and streams[0].last_seq == 1

            eventually(seen, "seq 1 applied")
            assert [s.state for s in service.subscriber.streams()] == [state]
    finally:
        pub.close()
