"""Does a JSON schema have a finite instance? llguidance compiles `{"properties": {"next": {"$ref":
"#"}}, "required": ["next"]}` without complaint, and decoding under it can only force
`{"next": {"next": ...` until `max_tokens`: a reply that can never match. This is the check that
refuses such a schema before decoding starts.

A least fixpoint over the schema's local `$ref`s: every reference starts "not finite", and one is
finite once its target is, until nothing changes. Judged generously where the rules are many
(`not`, `if`, numeric bounds, patterns, other keywords are taken to allow something): only a
schema whose every branch is forced to recurse is refused.
"""

from __future__ import annotations

from typing import Any

_PRIMITIVE = {"string", "number", "integer", "boolean", "null"}


def _pointer(root: Any, ref: str) -> Any:
    """The target of a local `#/a/b` reference, or None where it does not resolve."""
    node = root
    for part in ref[2:].split("/") if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _finite(schema: Any, refs: dict[str, bool]) -> bool:
    if not isinstance(schema, dict):
        return schema is not False
    ref = schema.get("$ref")
    if isinstance(ref, str) and not refs.get(ref, True):
        return False
    if "enum" in schema or "const" in schema:
        return True
    for key in ("anyOf", "oneOf"):
        alts = schema.get(key)
        if isinstance(alts, list) and alts and not any(_finite(a, refs) for a in alts):
            return False
    alls = schema.get("allOf")
    if isinstance(alls, list) and not all(_finite(a, refs) for a in alls):
        return False
    types = schema.get("type")
    allowed = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if allowed is not None and allowed & _PRIMITIVE:
        return True
    if allowed is None and not {"properties", "required", "items", "prefixItems"} & schema.keys():
        return True  # no type, no structure: a number will do
    options = []
    if allowed is None or "object" in allowed:
        props: dict = schema.get("properties") or {}
        required: list = schema.get("required") or []
        if not isinstance(props, dict) or not isinstance(required, list):
            return True
        options.append(all(_finite(props.get(r, True), refs) for r in required if isinstance(r, str)))
    if allowed is None or "array" in allowed:
        min_items = schema.get("minItems", 0)
        prefix: list = schema.get("prefixItems") or []
        if not isinstance(prefix, list):
            return True
        items = schema.get("items", True)
        need = [*prefix[:min_items]] if isinstance(min_items, int) else []
        if isinstance(min_items, int) and min_items > len(prefix):
            need.append(items)
        options.append(all(_finite(s, refs) for s in need))
    return any(options) if options else True


def has_finite_instance(schema: Any) -> bool:
    """False only when every instance of `schema` would have to be infinitely deep."""
    refs: dict[str, bool] = {}
    stack = [schema]
    while stack:  # the local references used anywhere in the schema
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                refs[ref] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    changed = True
    while changed:
        changed = False
        for ref, finite in refs.items():
            if not finite:
                target = schema if ref == "#" else _pointer(schema, ref)
                if target is None or _finite(target, refs):
                    refs[ref], changed = True, True
    return _finite(schema, refs)
