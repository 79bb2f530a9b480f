"""The method registry and the decoder-drafter contract: one spelling per method, typed hand-overs."""
import ast
import dataclasses
from pathlib import Path

import pytest
from test_tree_methods import add_random_eagle3_head, add_random_eagle_head, add_random_medusa_heads
from tiny_models import make_tiny_pair

from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.methods import registry as methods
from engine.methods.base import DrafterNeeds
from engine.models.loading import load_pair

PROMPT = "the cat sat on the mat. the cat sat on the"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("methods"))  # target hidden size 64
    add_random_medusa_heads(target, 64)
    add_random_eagle_head(target, 64)
    add_random_eagle3_head(target, 64)
    return SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


@pytest.mark.parametrize("spec, expected", [("draft", ("draft", 0)), ("eagle:8", ("eagle", 8)),
                                            ("medusa:16", ("medusa", 16)), (" none ", ("none", 0))])
def test_specs_parse_and_print_back(spec, expected):
    parsed = methods.parse_spec(spec)
    assert (parsed.name, parsed.tree_nodes) == expected
    assert methods.parse_spec(str(parsed)) == parsed


@pytest.mark.parametrize("spec, message", [("fast", "unknown method"), ("eagle:x", "NAME:TREE_NODES"),
                                           ("draft:4", "takes no tree size"), ("eagle:0", "between 1 and"),
                                           ("eagle:65", "between 1 and")])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(SpecplayError, match=message):
        methods.parse_spec(spec)


def test_every_menu_entry_is_a_valid_spec_with_a_label():
    for spec in methods.MENU_SPECS:
        parsed = methods.parse_spec(spec)
        assert parsed.label and parsed.label != parsed.name
    assert methods.spec_label("eagle", 8) == "EAGLE, dynamic tree of 8 nodes"
    assert set(methods.NAMES) == {methods.parse_spec(s).name for s in methods.MENU_SPECS}


def test_config_spec_round_trip():
    config = GenerationConfig(k=3).with_spec("eagle:8")
    assert (config.method, config.tree_nodes, config.k, config.spec) == ("eagle", 8, 3, "eagle:8")
    with pytest.raises(SpecplayError, match="takes no tree size"):
        GenerationConfig(method="ngram", tree_nodes=4).validate()


def test_registry_builds_each_method_and_reports_availability(decoder):
    availability = decoder.method_availability()
    assert set(availability) == set(methods.NAMES)
    assert all(reason is None for reason in availability.values()), availability
    for name, method in methods.METHODS.items():
        drafter = method.build(decoder, GenerationConfig(method=name))
        assert drafter.name == name


def test_unavailable_reasons_come_from_the_registry(tmp_path):
    reasons = methods.availability(has_draft_model=False, supports_tree=False, target_dir=str(tmp_path))
    assert reasons["none"] is None and reasons["ngram"] is None
    assert reasons["draft"] == "no draft model loaded"
    assert "Llama-family" in reasons["medusa"] and "Llama-family" in reasons["lookahead"]
    assert "Llama-family" in reasons["suffix"] and "Llama-family" in reasons["layerskip"]
    reasons = methods.availability(has_draft_model=True, supports_tree=True, target_dir=str(tmp_path))
    assert "medusa_heads.safetensors" in reasons["medusa"] and "eagle_head.safetensors" in reasons["eagle"]
    assert "eagle3_head.safetensors" in reasons["eagle3"]


@pytest.mark.parametrize("spec", ["none", "draft", "ngram", "medusa", "medusa-fixed", "eagle", "eagle:8",
                                  "eagle3", "eagle3:8", "lookahead", "suffix", "layerskip"])
def test_drafters_get_exactly_what_they_declare(decoder, monkeypatch, spec):
    """The decoder hands a drafter the prefill features, block features, logits and row argmax only when it
    asks."""
    config = GenerationConfig(k=3, max_new_tokens=12).with_spec(spec)
    method = methods.get(config.method)
    seen = {"start": [], "commit": []}

    def build(dec, cfg):
        drafter = method.build(dec, cfg)
        start, commit = drafter.start, drafter.commit

        def record_start(state, info):
            seen["start"].append(info)
            return start(state, info)

        def record_commit(state, info):
            seen["commit"].append(info)
            return commit(state, info)

        drafter.start, drafter.commit = record_start, record_commit
        return drafter

    monkeypatch.setitem(methods.METHODS, config.method, _with_build(method, build))
    events = list(decoder.generate(PROMPT, config))
    needs = method.build(decoder, config).needs
    assert isinstance(needs, DrafterNeeds)
    (start,) = seen["start"]
    assert (start.prefill_features is not None) == needs.prefill_features
    assert len(seen["commit"]) == len(events)
    for info, event in zip(seen["commit"], events):
        assert info.accepted == event.accepted_count
        assert len(info.accepted_rows) == info.accepted + 1 and info.accepted_rows[0] == 0
        assert info.draft_tokens == [t.token_id for t in event.drafted]
        assert (info.block_features is not None) == needs.block_features
        assert (info.block_logits is not None) == needs.block_logits
        assert (info.block_argmax is not None) == needs.block_argmax
        if needs.block_argmax:  # greedy: each accepted token, and the next one, is its parent row's argmax
            assert len(info.block_argmax) == len(event.drafted) + 1
            for node in (d for d in event.drafted if d.accepted):
                assert node.token_id == info.block_argmax[node.parent + 1]
            assert event.next_token_id == info.block_argmax[info.accepted_rows[-1]]
        if needs.block_features:
            assert info.block_features.shape[0] == len(event.drafted) + 1
            width = decoder.target.hidden_size * max(1, len(needs.tap_layers))  # EAGLE-3: the tapped layers
            assert info.block_features.shape[1] == width
            assert info.last_feature.shape == info.block_features.shape[1:]


def _with_build(method, build):
    return dataclasses.replace(method, build=build)


def test_no_string_keyed_state_dict_in_engine():
    """The typed contract replaced DecodeState.extras: no module under engine/ reads or writes `.extras`."""
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        uses = [node.lineno for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr == "extras"]
        assert not uses, f"{path.relative_to(ROOT)} uses .extras at lines {uses}"
