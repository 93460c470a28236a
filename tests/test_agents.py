"""Agents end to end on the embedded demo model (issue 29): the frameworks people build agents with, unchanged,
against a real `ferry serve` with no --model. Each runs a tool loop: at least one tool executed by the framework,
then a final answer (typed where the framework asks for a type). Only the temperature is set (0): the SDKs
sample at 1 by default, and a test must not depend on the draw.

Also the calls that used to fail on the 512-token model: a framework's tool prompt plus `max_tokens=200`, and
LangChain's JSON mode, which must end with an object that parses.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.server_harness import ServerProcess, server_process

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # litellm must not fetch its price list
MODEL = "default_model"
QUESTION = "What is the weather in Lisbon?"
WEATHER = {"city": "Lisbon", "temperature": 19, "condition": "cloudy"}


class Report(BaseModel):
    """The typed result the agents are asked for."""

    city: str
    temperature: int


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with server_process(None, "--log-level", "warning") as running:
        yield running


@pytest.fixture(scope="module")
def base_url(server: ServerProcess) -> str:
    return f"{server.base_url}/v1"


@pytest.fixture
def executed() -> list[tuple[str, dict[str, Any]]]:
    """The tool calls the framework under test ran, in order."""
    return []


def _weather_tool(executed: list[tuple[str, dict[str, Any]]]):
    def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        executed.append(("get_weather", {"city": city}))
        return json.dumps({**WEATHER, "city": city})

    return get_weather


def _add_tool(executed: list[tuple[str, dict[str, Any]]]):
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        executed.append(("add", {"a": a, "b": b}))
        return a + b

    return add


# ------------------------------------------------------------------------------------------------ plain clients

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_sdk_with_a_required_or_named_tool_and_200_tokens(base_url: str, choice: Any) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER_TOOL], tool_choice=choice,
        max_tokens=200, temperature=0,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls or []
    # Parallel calls are allowed (one only with a named choice); the model may repeat its call until the limit,
    # where the budget closes the last one (`length`).
    assert calls and reply.choices[0].finish_reason in ("tool_calls", "length")
    for call in calls:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


def _auto_loop(base_url: str) -> tuple[Any, str]:
    """`tool_choice: auto`: the call the model makes, and its answer once the tool's result is back."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    ask = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL], temperature=0)
    (call,) = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls"
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps(WEATHER)}
    final = client.chat.completions.create(
        model=MODEL, messages=[*ask, first.choices[0].message, result], tools=[WEATHER_TOOL], temperature=0
    )
    assert final.choices[0].finish_reason == "stop"
    return call, final.choices[0].message.content or ""


def test_auto_calls_an_offered_tool_then_answers_in_words(base_url: str) -> None:
    """The model opens a call by itself; the server holds it to the offered tools (strict auto), so the call is
    to get_weather with arguments that validate; after the result, a sentence that stops."""
    call, answer = _auto_loop(base_url)
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert answer and "<tool_call>" not in answer and sum(c.isalpha() or c == " " for c in answer) > 0.8 * len(answer)


def test_auto_asks_about_the_city_asked_and_answers_with_the_result(base_url: str) -> None:
    call, answer = _auto_loop(base_url)
    assert json.loads(call.function.arguments) == {"city": "Lisbon"}
    assert "19" in answer and "cloudy" in answer and "Lisbon" in answer, answer


def test_langchain_named_tool_choice_and_json_mode(base_url: str) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="none", temperature=0, max_retries=0)
    get_weather = tool(_weather_tool([]))
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    structured = llm.with_structured_output(None, method="json_mode").invoke("Describe a ferry as a JSON object.")
    assert isinstance(structured, dict)


def test_litellm_with_required_tools(base_url: str) -> None:
    import litellm

    reply = litellm.completion(
        model=f"openai/{MODEL}", api_base=base_url, api_key="none", messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER_TOOL], tool_choice="required", temperature=0,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)


# ------------------------------------------------------------------------------------------------ agent frameworks


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_two_tools_and_a_typed_result(
    base_url: str, api: str, executed: list[tuple[str, dict[str, Any]]]
) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    model_class = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    agent = Agent(
        name="Assistant",
        instructions="You are a helpful assistant.",
        tools=[function_tool(_weather_tool(executed)), function_tool(_add_tool(executed))],
        output_type=Report,
        model=model_class(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0),
    )
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4))
    assert executed and executed[0][0] == "get_weather"
    assert isinstance(result.final_output, Report)


def test_pydantic_ai_agent_with_a_tool_and_a_typed_result(
    base_url: str, executed: list[tuple[str, dict[str, Any]]]
) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="none"))
    agent = Agent(model, output_type=Report, model_settings={"temperature": 0})
    agent.tool_plain(_weather_tool(executed))
    result = agent.run_sync(QUESTION)
    assert executed and executed[0][0] == "get_weather"
    assert isinstance(result.output, Report)


def test_langchain_create_agent_runs_a_tool_loop(base_url: str, executed: list[tuple[str, dict[str, Any]]]) -> None:
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="none", temperature=0, max_retries=0)
    agent = create_agent(llm, tools=[tool(_weather_tool(executed)), tool(_add_tool(executed))])
    result = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
    kinds = [type(message).__name__ for message in result["messages"]]
    assert executed and "ToolMessage" in kinds and kinds[-1] == "AIMessage"
    assert result["messages"][-1].content and not result["messages"][-1].tool_calls
