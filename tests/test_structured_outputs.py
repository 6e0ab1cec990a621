"""Structured outputs (xgrammar) in the verifier, on the demo target: a JSON schema, JSON mode, a regex and an EBNF
grammar constrain the output; with every drafter (NGRAM, STANDALONE, EAGLE, EAGLE3) the constrained output equals
constrained plain decoding's token for token, greedy and seeded, drafts are proposed and accepted, and every output
parses and validates against its schema. The grammars' checks give messages that name what is wrong."""

from __future__ import annotations

import json
import re
import time

import pytest
import test_penalties
from test_fp8 import draft_flags
from test_speculative import ngram

from splitspec.demo import demo_model_dirs
from splitspec.runtime import grammar
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import Engine, SpecConfig

demo = test_penalties.demo  # the fixture: the demo target, its prompts, a transformers twin
NEW_TOKENS = 48
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "color", "size", "ok"], "additionalProperties": False}


def valid(text: str, schema: dict = SCHEMA) -> bool:
    """The text is JSON that validates against the schema (jsonschema, the tests' validator)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def setup(demo):
    from transformers import AutoTokenizer

    runner, prompts, _ = demo
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dirs()["target"])
    eos = {tokenizer.eos_token_id}
    return runner, prompts[:4], tokenizer, eos, grammar.Compiler(tokenizer, runner.config.vocab_size, eos)


def decode(setup, drafter, spec, params) -> list:
    runner, prompts, _, eos, compiler = setup
    engine = Engine(runner, drafter, spec or SpecConfig(), eos, grammars=compiler)
    requests = engine.run(prompts, [params] * len(prompts) if isinstance(params, SamplingParams) else params)
    assert runner.kv_cache.allocator.num_used == 0
    return requests


def drafter_for(algorithm: str, runner):
    """An in-process drafter of the demo pair and its tree shape."""
    if algorithm == "NGRAM":
        return ngram(), SpecConfig(num_draft_tokens=8)
    from splitspec.draft_models import build_drafter, capture_for
    from splitspec.speculation import resolve
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    heads = demo_model_dirs(heads=True)
    path = {"STANDALONE": demo_model_dirs()["draft"], "EAGLE": heads["eagle"], "EAGLE3": heads["eagle3"]}[algorithm]
    flags = draft_flags(algorithm, path, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                        "--speculative-num-draft-tokens", "6")
    drafter = build_drafter(resolve(flags), target=runner)
    runner.set_capture_layers(())  # the shared target: what an earlier test's drafter had it capture is not this one's
    capture_for(runner, drafter.hidden_state_layers)
    return InProcessDrafterClient(drafter), SpecConfig(num_draft_tokens=6, num_steps=3, topk=2)


def test_grammar_checks_name_the_problem():
    grammar.check("json_object", "")
    grammar.check("json_schema", json.dumps(SCHEMA))
    grammar.check("regex", r"[a-z]+\d{2}")
    grammar.check("ebnf", 'root ::= "yes" | "no"')
    for kind, text, message in [("json_schema", "{not json", "not JSON"), ("json_schema", '{"type": "objectx"}', "objectx"),
                                ("json_schema", "[1]", "an object or a boolean"), ("regex", "a(b", "parenthesis"),
                                ("ebnf", "root ::= missing", 'Rule "missing" is not defined'), ("regex", "", "empty")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            grammar.check(kind, text)
    with pytest.raises(ValueError, match="grammar kind"):
        SamplingParams(grammar=("xml", "<a/>"))


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_constrained_json_is_lossless_under_speculation_and_validates(setup, algorithm):
    runner, _, tokenizer, _, _ = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, grammar=("json_schema", json.dumps(SCHEMA)))
    plain = decode(setup, None, None, params)
    drafter, spec = drafter_for(algorithm, runner)
    speculated = decode(setup, drafter, spec, params)
    assert [r.output_ids for r in speculated] == [r.output_ids for r in plain]
    for request in plain:
        text = tokenizer.decode(request.output_ids, skip_special_tokens=True)
        assert request.finish_reason == "stop" and valid(text), text
    assert sum(r.stats.draft_tokens for r in speculated) > 0 and sum(r.stats.accepted_tokens for r in speculated) > 0
    assert all(r.stats.fallbacks == 0 for r in speculated)
    unconstrained = decode(setup, None, None, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert [r.output_ids for r in unconstrained] != [r.output_ids for r in plain]  # the grammar changed the text


SCHEMAS = [  # bounded (strings, arrays, numbers), so that a complete answer fits the token budget
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                                "maxItems": 3},
                                      "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                                                       "maximum": 9}},
                                                "required": ["x"]}},
     "required": ["tags", "inner"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["id", "note"]},
    {"anyOf": [{"type": "integer", "minimum": 100, "maximum": 200}, {"const": "none"}]},
]


def test_varied_schemas_all_validate_under_speculation(setup):
    _, prompts, tokenizer, _, _ = setup
    for schema in SCHEMAS:
        params = SamplingParams(temperature=0.0, max_new_tokens=64, grammar=("json_schema", json.dumps(schema)))
        plain = decode(setup, None, None, params)
        speculated = decode(setup, ngram(), SpecConfig(num_draft_tokens=8), params)
        assert [r.output_ids for r in speculated] == [r.output_ids for r in plain], schema
        for request in plain:
            text = tokenizer.decode(request.output_ids, skip_special_tokens=True)
            assert request.finish_reason == "stop" and valid(text, schema), (schema, text)


def test_seeded_regex_ebnf_and_json_mode_are_lossless_and_match(setup):
    runner, prompts, tokenizer, _, _ = setup
    cases = [("regex", r"(yes|no), [a-z]{2,8}\."), ("ebnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'),
             ("json_object", "")]
    for kind, text in cases:
        params = [SamplingParams(temperature=0.9, seed=21 + i, max_new_tokens=NEW_TOKENS, grammar=(kind, text))
                  for i in range(len(prompts))]
        plain = decode(setup, None, None, params)
        speculated = decode(setup, ngram(), SpecConfig(num_draft_tokens=8), params)
        assert [r.output_ids for r in speculated] == [r.output_ids for r in plain], kind
        for request in plain:
            out = tokenizer.decode(request.output_ids, skip_special_tokens=True)
            if request.finish_reason == "stop":  # complete: the whole text matches
                if kind == "regex":
                    assert re.fullmatch(text, out), out
                elif kind == "json_object":
                    assert isinstance(json.loads(out), dict), out
                else:
                    assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", out), out
        assert any(r.finish_reason == "stop" for r in plain), kind


def test_a_grammar_the_engine_cannot_compile_ends_only_its_request(setup):
    runner, prompts, _, eos, _ = setup
    engine = Engine(runner, None, SpecConfig(), eos)  # no compiler: structured outputs are off
    constrained = engine.add_request(prompts[0], SamplingParams(max_new_tokens=4, grammar=("json_object", "")))
    free = engine.add_request(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=4))
    events = []
    while engine.has_work:
        events += engine.step()
    assert constrained.finish_reason == "error" and free.finish_reason == "length" and len(free.output_ids) == 4
    assert any(e.request_id == constrained.request_id and "grammar engine" in e.error for e in events)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_in_process_drafters_never_propose_what_the_grammar_forbids(setup, algorithm):
    """A constrained request's trees, drafted in the verifier's process, hold only tokens its grammar allows after
    each node's path: the beam drafters mask every step's candidates to the grammar (drafting it on the host), NGRAM
    is asked for more candidates and its tree cut to the grammar and the budget, before the engine sees them. The
    output stays constrained plain decoding's, and drafts are accepted."""
    from splitspec.runtime.tree import DraftTree
    from splitspec.runtime.grammar_guide import grammar_rows

    runner, _, _, _, _ = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, grammar=("json_schema", json.dumps(SCHEMA)))
    plain = decode(setup, None, None, params)
    client, spec = drafter_for(algorithm, runner)
    checked, collect = [], client.collect

    def checked_collect(request_ids):
        matchers = {r: guide.matcher for r, guide in client._guides.items()}
        trees = collect(request_ids)
        for request_id, tree in trees.items():
            if isinstance(tree, DraftTree) and request_id in matchers:
                rows = grammar.xgrammar_module().allocate_token_bitmask(tree.num_nodes, runner.config.vocab_size)
                assert grammar_rows(tree, matchers[request_id], rows)[1] == list(range(tree.num_nodes)), tree
                checked.append(tree.num_nodes)
        return trees

    raw, draft = [], client.drafter.draft

    def masked_draft(request_ids, budgets, guides=None):  # a beam drafter's own trees, before the client's cut
        trees = draft(request_ids, budgets, guides) if guides is not None else draft(request_ids, budgets)
        for tree, guide in zip(trees, guides or []):
            if tree is not None and guide is not None:
                allowed = guide.node_masks(tree)
                # every candidate the drafter scored is one the grammar allows after its parent's path (a candidate
                # of probability 0, past what the grammar allows, is cut by the client)
                scored = [n for n in range(1, tree.num_nodes) if tree.scores[n] > 0]
                assert all(bool(allowed[tree.parents[n], tree.tokens[n]]) for n in scored), tree
                raw.append(len(scored))
        return trees

    client.collect, client.drafter.draft = checked_collect, masked_draft
    speculated = decode(setup, client, spec, params)
    assert [r.output_ids for r in speculated] == [r.output_ids for r in plain]
    assert len(checked) > 0 and max(checked) > 1 and max(checked) <= spec.num_draft_tokens  # within the budget
    assert (sum(raw) > 0) == (algorithm != "NGRAM")  # the beam drafters were handed the guides and scored candidates
    if algorithm == "NGRAM":  # asked for 4x the budget: candidates were cut and the trees still filled
        assert client.stats.grammar_cut > 0
    assert sum(r.stats.accepted_tokens for r in speculated) > 0 and all(r.stats.fallbacks == 0 for r in speculated)


def test_pruned_drafts_are_counted_and_none_are_left_to_prune_when_drafting_to_the_grammar(setup):
    """The verifier's pruning (spec_grammar_pruned_tokens) is what a drafter that drafts without the grammar (a drafter
    process: no matcher there) wastes; the in-process client, drafting to the grammar, leaves it nothing."""
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    class WithoutGrammar(InProcessDrafterClient):  # as a drafter process sees the asks: no guide
        def request(self, asks):
            for ask in asks:
                ask.guide = None
            super().request(asks)

    runner, prompts, _, eos, compiler = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, grammar=("json_schema", json.dumps(SCHEMA)))
    pruned, outputs = {}, {}
    for name, client in (("without", WithoutGrammar(ngram().drafter)), ("to the grammar", ngram())):
        engine = Engine(runner, client, SpecConfig(num_draft_tokens=8), eos, grammars=compiler)
        requests = [engine.add_request(p, params) for p in prompts]
        pruned[name] = 0
        while engine.has_work:
            engine.step()
            pruned[name] += engine.report.grammar_pruned
        outputs[name] = [r.output_ids for r in requests]
    assert pruned["without"] > 0 and pruned["to the grammar"] == 0
    assert outputs["without"] == outputs["to the grammar"]


def test_a_drafter_process_drafts_to_the_grammar_the_verifier_sends(setup):
    """Over the step channel: the verifier opens a constrained request at a drafter process with its grammar and
    prompt length; a drafter that knows the target's tokenizer (--model-path) compiles it, follows the output with
    a matcher and cuts its NGRAM trees to the grammar, so the verifier has nothing left to prune once the grammar is
    compiled there (the second wave, other prompts; the first compiles it); one without a tokenizer drafts as before and leaves
    some. Outputs equal constrained plain decoding's either way, drafts are accepted, nothing falls back."""
    from test_drafter_pool import start_drafter
    from test_verifier_service import free_port

    from splitspec.verifier_svc.drafter_pool import DrafterPool

    runner, prompts, _, eos, compiler = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, grammar=("json_schema", json.dumps(SCHEMA)))
    plain = [r.output_ids for r in decode(setup, None, None, params)]
    pruned, guided, cut = {}, {}, {}
    for name, flags in (("knows the grammar", ("--model-path", str(demo_model_dirs()["target"]))), ("no tokenizer", ())):
        pool = DrafterPool(f"tcp://127.0.0.1:{free_port()}", "NGRAM", runner.config.vocab_size, timeout=5.0,
                           heartbeat_timeout=30.0)
        process = start_drafter(pool.address, "grammar", "--speculative-num-draft-tokens", "8", "--metrics-port", "0",
                                *flags)
        try:
            assert pool.wait_for_drafters(1, 60.0)
            metrics_url = f"http://{pool.scrape_targets()[0]['targets'][0]}/metrics"
            engine = Engine(runner, pool, SpecConfig(num_draft_tokens=8), eos, grammars=compiler)
            for wave, (first, last) in enumerate(((0, 2), (2, 4))):  # other prompts: NGRAM's cache holds wave 0's outputs
                if wave == 1 and flags:  # the drafter's first compile (its tokenizer loads) may outlast wave 0
                    deadline = time.monotonic() + 60
                    while not drafter_metric(metrics_url, "splitspec:drafter_grammar_compiles_total", outcome="ok"):
                        assert time.monotonic() < deadline, "the drafter never compiled the grammar"
                        time.sleep(0.2)
                requests = [engine.add_request(p, params) for p in prompts[first:last]]
                pruned[name, wave] = 0
                while engine.has_work:
                    engine.step()
                    pruned[name, wave] += engine.report.grammar_pruned
                assert [r.output_ids for r in requests] == plain[first:last]
                assert all(r.stats.fallbacks == 0 for r in requests) and sum(r.stats.accepted_tokens for r in requests) > 0
            assert pool.stats.faults == 0
            guided[name] = drafter_metric(metrics_url, "splitspec:drafter_constrained_trees_total", guided="yes")
            cut[name] = drafter_metric(metrics_url, "splitspec:drafter_grammar_cut_tokens_total")
        finally:
            pool.close()
            process.kill()
            process.wait(timeout=30)
    assert pruned["knows the grammar", 1] == 0 and pruned["no tokenizer", 1] > 0, pruned
    assert guided["knows the grammar"] > 0 and cut["knows the grammar"] > 0  # NGRAM asked for more, cut to the grammar
    assert guided["no tokenizer"] == 0 and cut["no tokenizer"] == 0


def drafter_metric(url: str, name: str, **labels) -> float:
    """One sample of a drafter's /metrics (summed over the series with these labels)."""
    from test_verifier_service import scrape

    return sum(v for (n, ls), v in scrape(url).items() if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def test_a_drafter_follows_the_output_however_the_request_was_opened(setup):
    """drafter_svc.grammars: a drafter of hidden states is opened with the prompt's first token (the rest of the prompt
    comes in its asks), NGRAM with the prompt, a re-pinned request with prompt and output so far; each way its matcher
    stands where the verifier's stands (after the same output tokens). A token the grammar refuses (another
    tokenizer) leaves the request unguided, not failed."""
    from splitspec.drafter_svc.grammars import RequestGrammars

    runner, prompts, _, _, compiler = setup
    spec = ("json_schema", json.dumps(SCHEMA))
    prompt = prompts[0]
    output = decode(setup, None, None, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, grammar=spec))[0].output_ids
    head = output[:7]
    grammars = RequestGrammars(compiler, runner.config.vocab_size)
    grammars.open("hidden", prompt[:1], spec, len(prompt))
    grammars.extend("hidden", prompt[1:5])
    grammars.extend("hidden", prompt[5:] + head[:3])
    grammars.extend("hidden", head[3:])
    grammars.open("ngram", prompt, spec, len(prompt))
    grammars.extend("ngram", head)
    grammars.open("repinned", prompt + head, spec, len(prompt))
    grammars.open("refused", prompt, spec, len(prompt))
    grammars.extend("refused", [head[1]])  # not a JSON object's first token
    grammars.open("plain", prompt, None, len(prompt))
    grammars.tracked["ngram"].compiled.result(timeout=60)
    reference = compiler.matcher(compiler.compile(spec).result(timeout=60))
    for token in head:
        assert reference.accept_token(token)
    xgr = grammar.xgrammar_module()
    expected = xgr.allocate_token_bitmask(1, runner.config.vocab_size)
    reference.fill_next_token_bitmask(expected, 0)
    for request_id in ("hidden", "ngram", "repinned"):
        guide = grammars.guide(request_id)
        rows = xgr.allocate_token_bitmask(1, runner.config.vocab_size)
        guide.matcher.fill_next_token_bitmask(rows, 0)
        assert rows.equal(expected), request_id
    assert grammars.guide("refused") is None and grammars.guide("plain") is None
    assert grammars.constrained("refused") and not grammars.constrained("plain")
