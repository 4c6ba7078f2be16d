"""The cheap bounds on a constraint (``structured_output/limits.py``), checked while its spec is
built: no model, no compiler. Issue 35 item 1: a 3,000-long ``$ref`` chain or rule chain crashed
llguidance's compiler; here it is refused, with the limit named, before anything compiles it."""

from __future__ import annotations

import json

import pytest

from pagedllm.structured_output import StructuredOutputError, StructuredOutputsParams
from pagedllm.structured_output import limits


def ref_chain_schema(n: int) -> dict:
    """The issue's schema: ``$defs`` d0 -> d1 -> ... -> dn (an integer), the root a ``$ref`` to d0."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def refused(**fields) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as e:
        StructuredOutputsParams(**fields).grammar_spec()
    return e.value


def test_the_issues_ref_chain_is_refused_naming_the_limit():
    e = refused(json=ref_chain_schema(3000))
    assert e.param == "structured_outputs.json"
    assert str(e) == ("structured_outputs.json: the schema's $ref chain is more than 128 references long; at most "
                      "128 are accepted")
    # as JSON text too, and one past the limit
    assert refused(json=json.dumps(ref_chain_schema(3000))).param == "structured_outputs.json"
    assert "$ref chain" in str(refused(json=ref_chain_schema(limits.MAX_REF_CHAIN)))  # root -> d0 is a hop too


def test_chains_within_the_limit_and_recursive_schemas_pass():
    StructuredOutputsParams(json=ref_chain_schema(limits.MAX_REF_CHAIN - 1)).grammar_spec()
    assert limits.ref_chain(ref_chain_schema(limits.MAX_REF_CHAIN - 1)) == limits.MAX_REF_CHAIN
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        "parent": {"$ref": "#"}}}}, "$ref": "#/$defs/node"}
    StructuredOutputsParams(json=tree).grammar_spec()  # cycles are legal: the compiler stops at them
    assert limits.ref_chain(tree) == 2  # root -> node, then the cycles end the path


def test_ref_pointers_are_unescaped_and_hops_counted_exactly():
    doc = {"$defs": {"a/b": {"$ref": "#/$defs/c~0d"}, "c~d": {"$ref": "#/$defs/e%20f"}, "e f": {"type": "string"}},
           "items": [{"$ref": "#/$defs/a~1b"}]}
    assert limits.ref_chain(doc) == 3
    assert limits.ref_chain({"$ref": "other.json#/x"}) == 0  # not this document: llguidance says what it thinks


def test_rule_chains_are_refused_in_lark_and_gbnf():
    e = refused(grammar=lark_chain(3000))  # also over the rule count
    assert e.param == "structured_outputs.grammar" and "at most 1000 are accepted" in str(e)
    e = refused(grammar=lark_chain(500))
    assert str(e) == ("structured_outputs.grammar: the grammar's rule references chain more than 128 rules deep; "
                      "at most 128 are accepted")
    assert "rules deep" in str(refused(grammar=gbnf_chain(300)))
    assert "more than 1000 rules" in str(refused(grammar=gbnf_chain(3000)))  # before the slow GBNF converter
    StructuredOutputsParams(grammar=lark_chain(100)).grammar_spec()
    StructuredOutputsParams(grammar='start: item+\nitem: "(" start ")" | "x"\n').grammar_spec()  # recursion


def test_a_schema_inlined_in_lark_and_in_a_structural_tag_is_checked():
    e = refused(grammar='start: "x" %json ' + json.dumps(ref_chain_schema(300)))
    assert e.param == "structured_outputs.grammar" and "$ref chain" in str(e)
    tag = {"structures": [{"begin": "<f>", "schema": ref_chain_schema(300), "end": "</f>"}], "triggers": ["<f"]}
    e = refused(structural_tag=json.dumps(tag))
    assert e.param == "structured_outputs.structural_tag" and "$ref chain" in str(e)


def test_depth_is_measured_without_recursion():
    deep: dict = {"type": "integer"}
    for _ in range(100_000):  # as a request body can hold; the checks must not raise RecursionError
        deep = {"type": "object", "properties": {"a": deep}}
    assert limits.json_depth(deep, limit=10**9) == 200_001
    e = refused(json=deep)
    assert str(e) == "structured_outputs.json: the schema nests more than 100 levels deep; at most 100 are accepted"
    chain = [{"$ref": f"#/{i + 1}"} for i in range(20_000)] + [{}]
    assert limits.ref_chain(chain, limit=10**9) == 20_000
    text = '{"a":' * 40_000 + "1" + "}" * 40_000
    assert "levels deep" in str(refused(json=text))


def test_size_is_capped_for_every_kind():
    big = "x" * 1_000_000
    assert str(refused(json={"const": big})) == ("structured_outputs.json: the schema is 1000013 bytes; at most "
                                                 "262144 are accepted")
    assert "the grammar is 1000009 bytes" in str(refused(grammar=f'start: "{big}"'))
    assert "the regex is" in str(refused(regex=big))
    assert "the choice list is" in str(refused(choice=[big]))
    assert refused(choice=["abc"] * 60_000).param == "structured_outputs.choice"
    # bytes, not characters: 70,000 four-byte characters
    assert "280013 bytes" in str(refused(json={"const": "\U0001F600" * 70_000}))
    StructuredOutputsParams(json={"const": "x" * 200_000}).grammar_spec()


def test_longest_chain_walks_cycles_and_shared_nodes_once():
    graph = {"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": ["a", "e"], "e": []}
    calls: list[str] = []

    def succ(n):
        calls.append(n)
        return [(m, 1) for m in graph[n]]

    assert limits.longest_chain(succ, "a", 100) == 3  # a b d e; d -> a is a cycle
    assert sorted(calls) == ["a", "b", "c", "d", "e"]
    line = {i: [i + 1] for i in range(10_000)}
    assert limits.longest_chain(lambda n: [(m, 1) for m in line.get(n, [])], 0, 50) == 51  # stops past the limit
