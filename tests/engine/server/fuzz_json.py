"""hypothesis strategies for the loosely typed JSON of API requests: objects keyed and tagged by
the words the converters branch on, so drawn values reach their inner paths."""

from __future__ import annotations

from hypothesis import strategies as st

# The keys and tags the converters branch on, so drawn objects reach their inner paths.
WORDS = (
    "type", "function", "name", "arguments", "parameters", "properties", "schema",
    "json_schema", "format", "edits", "keep", "value", "call_id", "content", "text", "role",
    "output", "summary", "strict", "tools", "input_schema", "tool_use_id", "id", "input",
    "thinking", "is_error", "json_object", "message", "function_call", "function_call_output",
    "reasoning", "namespace", "tool_use", "tool_result", "redacted_thinking", "all",
    "clear_thinking_20251015", "thinking_turns", "auto", "any", "tool", "none", "required",
    "input_text", "output_text", "user", "assistant", "system", "developer", "object", "string",
    "enable_thinking", "description", "budget_tokens", "enabled",
)  # fmt: skip
WORD = st.sampled_from(WORDS) | st.text(max_size=6)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 70000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | WORD,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(WORD, inner, max_size=4),
    max_leaves=10,
)
OBJECT = st.dictionaries(WORD, JSON, max_size=4)
TYPED = st.builds(lambda kind, rest: {**rest, "type": kind}, st.sampled_from(WORDS), OBJECT)

ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool"])


def chat_message(part: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """An OpenAI chat message of any role with any subset of its fields; content parts from
    `part`."""
    return st.fixed_dictionaries(
        {"role": ROLE},
        optional={
            "content": st.none() | WORD | st.lists(part, max_size=3),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "function": st.fixed_dictionaries(
                            {"name": WORD}, optional={"arguments": JSON}
                        )
                    },
                    optional={"id": WORD},
                ),
                max_size=2,
            ),
            "tool_call_id": WORD,
            "reasoning_content": WORD,
        },
    )
