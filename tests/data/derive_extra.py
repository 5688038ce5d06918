"""Derive dsv4_encoder_extra.jsonl from the public cases by the reference's rules.

`python tests/data/derive_extra.py PUBLIC.jsonl OUT.jsonl`. It imports nothing
from mlxserve: every prompt is a public reference prompt, either unchanged or
with one parameter line rewritten as the reference's rule writes it.
"""

import copy
import json
import sys

with open(sys.argv[1], encoding="utf-8") as public:
    src = {c["id"]: c for c in map(json.loads, public)}
out = []


def case(cid, variant, request, base, tags, prompt=None, error=False, how=""):
    c = {"id": cid, "variant": variant, "request": request}
    if error:
        c["error"] = True
    else:
        c["prompt"] = prompt
    c["tags"] = sorted(tags)
    c["derived_from"] = base
    c["derivation"] = how
    out.append(c)


def with_args(base_id, value):
    r = copy.deepcopy(src[base_id]["request"])
    for m in r["messages"]:
        for tc in m.get("tool_calls") or []:
            tc["function"]["arguments"] = value
    return r


# Family A: tool-call arguments that are valid JSON but not an object.
obj = {"city": "Paris", "unit": "celsius"}
double = json.dumps(json.dumps(obj))
case(
    "enc-ext-0001",
    "v41",
    with_args("enc-pub-0041", double),
    "enc-pub-0041",
    ["tools", "args_double_encoded", "thinking", "reasoning_history"],
    src["enc-pub-0041"]["prompt"],
    how="V4.1 decodes a JSON string up to twice: the double-encoded object renders as the object",
)
base = src["enc-pub-0051"]["prompt"]
old = 'string="true">{not json<'
assert base.count(old) == 1
n = 2
for raw, tag in [
    ("[1, 2]", "args_json_array"),
    ("42", "args_json_number"),
    ("null", "args_json_null"),
    ("true", "args_json_bool"),
    ('"Paris"', "args_json_string_value"),
    (json.dumps("[1, 2]"), "args_double_encoded"),
]:
    case(
        f"enc-ext-{n:04d}",
        "v41",
        with_args("enc-pub-0051", raw),
        "enc-pub-0051",
        ["tools", "ends_with_tool", "args_not_object", tag],
        base.replace(old, f'string="true">{raw}<'),
        how="not an object after decoding: one 'arguments' parameter holding the original string",
    )
    n += 1
case(
    f"enc-ext-{n:04d}",
    "v41",
    with_args("enc-pub-0051", [1, 2]),
    "enc-pub-0051",
    ["tools", "ends_with_tool", "args_not_object", "args_decoded_array"],
    base.replace(old, 'string="false">[1, 2]<'),
    how="a decoded non-object value: one 'arguments' parameter, JSON with string=\"false\"",
)
n += 1
for raw, tag in [("[1, 2]", "args_json_array"), (double, "args_double_encoded")]:
    r = with_args("enc-pub-0051", raw)
    case(
        f"enc-ext-{n:04d}",
        "v4",
        r,
        "enc-pub-0051",
        ["tools", "ends_with_tool", "args_not_object", tag, "error"],
        error=True,
        how="V4 decodes once and needs an object: an error",
    )
    n += 1


# Family B: developer messages with empty content.
def insert_dev(base_id, at, **extra):
    r = copy.deepcopy(src[base_id]["request"])
    r["messages"].insert(at, {"role": "developer", "content": ""})
    r.update(extra)
    return r


for base_id, at in [
    ("enc-pub-0053", 0),
    ("enc-pub-0017", 2),
    ("enc-pub-0059", 2),
    ("enc-pub-0096", 0),
]:
    b = src[base_id]
    case(
        f"enc-ext-{n:04d}",
        b["variant"],
        insert_dev(base_id, at),
        base_id,
        ["empty_developer", "thinking", "dropped_developer"],
        b["prompt"],
        how="thinking + drop_thinking, no tools: developer messages before the last user turn are "
        "dropped before rendering, so the empty one renders as nothing",
    )
    n += 1
# Kept empty developer messages stay errors.
for base_id, extra, tag in [
    ("enc-pub-0017", {"drop_thinking": False}, "drop_thinking_false"),
    ("enc-pub-0059", {"drop_thinking": False}, "drop_thinking_false"),
]:
    b = src[base_id]
    case(
        f"enc-ext-{n:04d}",
        b["variant"],
        insert_dev(base_id, 2, **extra),
        base_id,
        ["empty_developer", "thinking", tag, "error"],
        error=True,
        how="nothing is dropped, the empty developer message is rendered: an error",
    )
    n += 1
for base_id in ("enc-pub-0017", "enc-pub-0059"):
    b = src[base_id]
    r = insert_dev(base_id, len(b["request"]["messages"]))
    case(
        f"enc-ext-{n:04d}",
        b["variant"],
        r,
        base_id,
        ["empty_developer", "thinking", "error"],
        error=True,
        how="the last user/developer turn is kept: an error",
    )
    n += 1
r = insert_dev("enc-pub-0041", 2)
r["messages"].append({"role": "user", "content": "Thanks."})
case(
    f"enc-ext-{n:04d}",
    "v41",
    r,
    "enc-pub-0041",
    ["empty_developer", "thinking", "tools", "error"],
    error=True,
    how="tools switch drop_thinking off, so nothing is dropped: an error",
)
n += 1

# Family C (V4.1): a system message after the first counts as a user turn: it
# ends the history drop-thinking hides and opens the reply that follows it.
# V4 treats it as bare text.
SYSTEM = {"role": "system", "content": "Be brief."}


def replaced(base_id: str, old: str, new: str) -> str:
    prompt = src[base_id]["prompt"]
    assert prompt.count(old) == 1, (base_id, old)
    return prompt.replace(old, new)


def appended(base_id: str, at: int | None = None, drop_last: bool = False) -> dict:
    r = copy.deepcopy(src[base_id]["request"])
    if drop_last:
        r["messages"].pop()
    r["messages"].insert(len(r["messages"]) if at is None else at, dict(SYSTEM))
    return r


for base_id, header in [("enc-pub-0032", "</think>"), ("enc-pub-0025", "<think>")]:
    case(
        f"enc-ext-{n:04d}",
        "v41",
        appended(base_id),
        base_id,
        ["mid_system", "ends_with_system"] + (["thinking"] if header == "<think>" else []),
        replaced(
            base_id,
            f"<｜Assistant｜>{header}",
            f"<｜System｜>Be brief.<｜Assistant｜>{header}",
        ),
        how="a final system message after the first opens the reply; the user turn before it "
        "is not followed by an assistant, so it gets no header",
    )
    n += 1
case(
    f"enc-ext-{n:04d}",
    "v41",
    appended("enc-pub-0044", at=2),
    "enc-pub-0044",
    ["mid_system", "thinking", "reasoning_history"],
    replaced(
        "enc-pub-0044",
        "<｜end▁of▁sentence｜><｜User｜>2+2?",
        "<｜end▁of▁sentence｜><｜System｜>Be brief.<｜User｜>2+2?",
    ),
    how="a mid-conversation system message followed by a user turn: its text, no header",
)
n += 1
case(
    f"enc-ext-{n:04d}",
    "v41",
    appended("enc-pub-0044", drop_last=True),
    "enc-pub-0044",
    ["mid_system", "ends_with_system", "thinking", "reasoning_history"],
    replaced(
        "enc-pub-0044",
        "<｜User｜>2+2?<｜Assistant｜><think>",
        "<｜System｜>Be brief.<｜Assistant｜><think>",
    ),
    how="the system message replaces the last user turn: the reply before it keeps its "
    "reasoning hidden (drop-thinking) and the system message opens the next reply",
)
n += 1
prompt = replaced("enc-pub-0017", "<｜User｜>2+2?<｜Assistant｜><think>", "Be brief.")
assert prompt.count("<｜Assistant｜></think>Hello!") == 1
case(
    f"enc-ext-{n:04d}",
    "v4",
    appended("enc-pub-0017", drop_last=True),
    "enc-pub-0017",
    ["mid_system", "ends_with_system", "thinking", "reasoning_history"],
    prompt.replace(
        "<｜Assistant｜></think>Hello!", "<｜Assistant｜><think>Greet back.</think>Hello!"
    ),
    how="V4: a system message is bare text and no user turn, so the reply before it is after "
    "the last user turn and shows its reasoning",
)
n += 1

# Family A, continued: JSON null. V4's wrapper turns `arguments: null` into {}
# (public cases enc-pub-0078/0080/0114); V4.1's hands the value to the encoder,
# which renders a non-object value as one 'arguments' parameter, as JSON.
case(
    f"enc-ext-{n:04d}",
    "v41",
    with_args("enc-pub-0051", None),
    "enc-pub-0051",
    ["tools", "ends_with_tool", "args_not_object", "args_null_value"],
    base.replace(old, 'string="false">null<'),
    how="V4.1 keeps a null value: one 'arguments' parameter, JSON with string=\"false\"",
)
n += 1
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for c in out:
        f.write(json.dumps(c, ensure_ascii=False) + "\n")
print(len(out), "cases")
