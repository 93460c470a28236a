"""Synthetic tool-use conversations for the demo model's second training phase (scripts/train_demo_model.py).

Each transcript is a list of OpenAI-style chat messages plus the tools offered, rendered later by the model's own
chat template with `tools`, so the model learns exactly the format `ferry serve` shows it and the hermes parser
reads back. What the model must learn is copying, not facts: the function name from the offered tools, argument
values from the question, and the figures of the tool's result into a one-sentence answer. So every family varies
its function and parameter names, its schema's decorations (the shapes the OpenAI SDK, LangChain, pydantic and the
Agents SDK send), and draws its values at random.

Pure Python and seeded: the same `random.Random` gives the same transcripts.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
Tool = dict[str, Any]

CITIES = [
    "Paris",
    "London",
    "Berlin",
    "Madrid",
    "Rome",
    "Lisbon",
    "Vienna",
    "Prague",
    "Warsaw",
    "Dublin",
    "Oslo",
    "Stockholm",
    "Helsinki",
    "Copenhagen",
    "Athens",
    "Istanbul",
    "Cairo",
    "Lagos",
    "Nairobi",
    "Accra",
    "Tunis",
    "Casablanca",
    "Johannesburg",
    "Dubai",
    "Doha",
    "Tehran",
    "Karachi",
    "Delhi",
    "Mumbai",
    "Dhaka",
    "Bangkok",
    "Hanoi",
    "Manila",
    "Jakarta",
    "Singapore",
    "Seoul",
    "Tokyo",
    "Osaka",
    "Beijing",
    "Shanghai",
    "Sydney",
    "Melbourne",
    "Auckland",
    "Lima",
    "Bogota",
    "Quito",
    "Santiago",
    "Montevideo",
    "Caracas",
    "Havana",
    "Toronto",
    "Montreal",
    "Vancouver",
    "Chicago",
    "Boston",
    "Denver",
    "Seattle",
    "Houston",
    "Miami",
    "Atlanta",
    "Phoenix",
    "Dallas",
    "Austin",
    "Zurich",
    "Geneva",
    "Brussels",
    "Amsterdam",
    "Rotterdam",
    "Hamburg",
    "Munich",
    "Milan",
    "Naples",
    "Venice",
    "Florence",
    "Seville",
    "Valencia",
    "Porto",
    "Krakow",
    "Budapest",
    "Bucharest",
    "Sofia",
    "Belgrade",
    "Zagreb",
    "Riga",
    "Vilnius",
    "Tallinn",
    "Reykjavik",
    "Kyoto",
    "Taipei",
    "Perth",
    "Adelaide",
    "Marseille",
    "Lyon",
    "Nice",
    "Bordeaux",
    "Glasgow",
    "Edinburgh",
    "Cardiff",
    "Belfast",
    "Bristol",
    "Leeds",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
FIRST_NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Irene",
    "Jack",
    "Karen",
    "Liam",
    "Maria",
    "Noah",
    "Olga",
    "Peter",
    "Rosa",
    "Sam",
]
LAST_NAMES = [
    "Smith",
    "Jones",
    "Brown",
    "Garcia",
    "Miller",
    "Davis",
    "Lopez",
    "Wilson",
    "Moore",
    "Taylor",
    "Martin",
    "Lee",
    "Walker",
    "Young",
    "King",
    "Scott",
]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "NOK", "INR"]
ORDER_STATES = ["shipped", "delivered", "processing", "cancelled", "out for delivery", "waiting for payment"]
TOPICS = [
    "json",
    "os",
    "sys",
    "math",
    "random",
    "re",
    "time",
    "datetime",
    "pathlib",
    "itertools",
    "functools",
    "collections",
    "logging",
    "argparse",
    "csv",
    "sqlite3",
    "socket",
    "threading",
    "asyncio",
    "subprocess",
    "shutil",
    "tempfile",
    "hashlib",
    "base64",
    "zipfile",
    "gzip",
    "pickle",
    "copy",
    "heapq",
    "bisect",
    "statistics",
    "decimal",
    "fractions",
    "string",
    "textwrap",
    "unittest",
    "typing",
    "dataclasses",
    "enum",
    "uuid",
    "urllib",
    "http",
    "email",
]
AGENT_INSTRUCTIONS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Use the tools when they help.",
    "You are a helpful agent.",
    "Answer the user's question. Call a tool when you need data.",
    "You are an assistant with access to tools.",
    "Be brief.",
]


@dataclass(frozen=True)
class Param:
    """One parameter as a family offers it: the name variants it may go by, its JSON type and description."""

    names: tuple[str, ...]
    type: str
    description: str


@dataclass(frozen=True)
class Result:
    """A tool's result: the text the tool returns, and its fields (what a typed final answer copies)."""

    text: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Call:
    """What one tool use looks like once names are drawn: the call's arguments, its result and the answer."""

    arguments: dict[str, Any]
    result: Result
    answer: str


@dataclass(frozen=True)
class Family:
    """A kind of tool: its name variants, descriptions, parameters and how a question, call and answer look.

    `draw(rng, names)` gets the parameter names drawn for this transcript (parameter -> name) and returns the
    question and the call.
    """

    names: tuple[str, ...]
    descriptions: tuple[str, ...]
    params: tuple[Param, ...]
    draw: Callable[[random.Random, list[str]], tuple[str, Call]]
    draw_pair: Callable[[random.Random, list[str]], tuple[str, Call, Call]] | None = None


def _result(rng: random.Random, fields: dict[str, Any], text: str) -> Result:
    """A tool's result as tools return it: JSON most of the time, sometimes a plain sentence fragment."""
    return Result(text if rng.random() < 0.25 else json.dumps(fields), fields)


def _weather_call(rng: random.Random, names: list[str], city: str) -> Call:
    temperature, condition = rng.randint(-5, 38), rng.choice(CONDITIONS)
    result = _result(
        rng, {"city": city, "temperature": temperature, "condition": condition}, f"{temperature} degrees, {condition}"
    )
    return Call({names[0]: city}, result, f"It is {temperature} degrees and {condition} in {city}.")


def _weather(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    city = rng.choice(CITIES)
    question = rng.choice(
        [
            "What is the weather in {}?",
            "What's the weather like in {}?",
            "How is the weather in {} today?",
            "Tell me the weather in {}.",
            "Is it raining in {}?",
            "What is the temperature in {} right now?",
        ]
    )
    return question.format(city), _weather_call(rng, names, city)


def _weather_pair(rng: random.Random, names: list[str]) -> tuple[str, Call, Call]:
    first, second = rng.sample(CITIES, 2)
    question = rng.choice(["What is the weather in {} and in {}?", "How is the weather in {} and {}?"])
    return question.format(first, second), _weather_call(rng, names, first), _weather_call(rng, names, second)


def _time_call(rng: random.Random, names: list[str], city: str) -> Call:
    clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return Call({names[0]: city}, _result(rng, {"city": city, "time": clock}, clock), f"It is {clock} in {city}.")


def _time(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    city = rng.choice(CITIES)
    question = rng.choice(["What time is it in {}?", "What is the time in {}?", "Tell me the current time in {}."])
    return question.format(city), _time_call(rng, names, city)


def _time_pair(rng: random.Random, names: list[str]) -> tuple[str, Call, Call]:
    first, second = rng.sample(CITIES, 2)
    question = rng.choice(["What time is it in {} and in {}?", "What is the time in {} and {}?"])
    return question.format(first, second), _time_call(rng, names, first), _time_call(rng, names, second)


def _number(rng: random.Random) -> int:
    return rng.choice([rng.randint(0, 20), rng.randint(0, 999), rng.randint(1000, 99999)])


def _add(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    a, b = _number(rng), _number(rng)
    question = rng.choice(
        ["What is {} plus {}?", "Add {} and {}.", "What is the sum of {} and {}?", "Compute {} + {}."]
    )
    result = _result(rng, {"result": a + b}, str(a + b))
    return question.format(a, b), Call({names[0]: a, names[1]: b}, result, f"{a} plus {b} is {a + b}.")


def _multiply(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    a, b = _number(rng), rng.randint(0, 99)
    question = rng.choice(["What is {} times {}?", "Multiply {} by {}.", "What is the product of {} and {}?"])
    result = _result(rng, {"result": a * b}, str(a * b))
    return question.format(a, b), Call({names[0]: a, names[1]: b}, result, f"{a} times {b} is {a * b}.")


def _stock(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    symbol = "".join(rng.choices(string.ascii_uppercase, k=rng.randint(2, 4)))
    price = round(rng.uniform(1, 900), 2)
    question = rng.choice(
        ["What is the stock price of {}?", "How much does {} stock cost?", "Get me the price of {}.", "Quote {}."]
    )
    result = _result(rng, {"symbol": symbol, "price": price, "currency": "USD"}, f"{price} USD")
    return question.format(symbol), Call({names[0]: symbol}, result, f"{symbol} trades at {price} USD.")


def _population(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    city = rng.choice(CITIES)
    people = rng.randint(20_000, 20_000_000)
    question = rng.choice(["What is the population of {}?", "How many people live in {}?", "How big is {}?"])
    result = _result(rng, {"city": city, "population": people}, str(people))
    return question.format(city), Call({names[0]: city}, result, f"{city} has a population of {people}.")


def _convert(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    amount = rng.choice([rng.randint(1, 100), rng.randint(100, 10_000)])
    source, target = rng.sample(CURRENCIES, 2)
    converted = round(amount * rng.uniform(0.01, 150), 2)
    question = rng.choice(["Convert {} {} to {}.", "How much is {} {} in {}?", "What is {} {} in {}?"])
    result = _result(rng, {"amount": converted, "currency": target}, f"{converted} {target}")
    arguments = {names[0]: amount, names[1]: source, names[2]: target}
    return question.format(amount, source, target), Call(
        arguments, result, f"{amount} {source} is {converted} {target}."
    )


def _user(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    user_id = rng.randint(1, 9999)
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    email = f"{first.lower()}.{last.lower()}@example.com"
    question = rng.choice(["Who is user {}?", "Look up user {}.", "Find the user with id {}.", "Show me user {}."])
    result = _result(rng, {"id": user_id, "name": f"{first} {last}", "email": email}, f"{first} {last}, {email}")
    answer = f"User {user_id} is {first} {last}, and their email is {email}."
    return question.format(user_id), Call({names[0]: user_id}, result, answer)


def _order(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    order = rng.choice(string.ascii_uppercase) + str(rng.randint(1000, 99999))
    state = rng.choice(ORDER_STATES)
    question = rng.choice(["Where is my order {}?", "What is the status of order {}?", "Track order {}."])
    result = _result(rng, {"order_id": order, "status": state}, state)
    return question.format(order), Call({names[0]: order}, result, f"Order {order} is {state}.")


def _distance(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    origin, destination = rng.sample(CITIES, 2)
    kilometres = rng.randint(5, 19_000)
    question = rng.choice(["How far is it from {} to {}?", "What is the distance between {} and {}?"])
    result = _result(rng, {"distance_km": kilometres}, f"{kilometres} km")
    answer = f"It is {kilometres} kilometers from {origin} to {destination}."
    return question.format(origin, destination), Call({names[0]: origin, names[1]: destination}, result, answer)


def _docs(rng: random.Random, names: list[str]) -> tuple[str, Call]:
    topic = rng.choice(TOPICS)
    question = rng.choice(
        ["Search the docs for {}.", "Look up {} in the documentation.", "Find documentation about the {} module."]
    )
    page = f"https://docs.python.org/3/library/{topic}.html"
    result = _result(rng, {"results": [{"title": f"{topic} module", "url": page}]}, page)
    return question.format(topic), Call({names[0]: topic}, result, f"The documentation of {topic} is at {page}.")


_CITY = Param(("city", "location", "place", "city_name"), "string", "The name of the city.")
FAMILIES: tuple[Family, ...] = (
    Family(
        ("get_weather", "get_current_weather", "weather", "lookup_weather", "fetch_weather"),
        ("Get the current weather in a given city.", "Return the weather for a location.", "Weather lookup."),
        (_CITY,),
        _weather,
        _weather_pair,
    ),
    Family(
        ("get_time", "get_current_time", "current_time", "local_time"),
        ("Get the current local time in a city.", "Return the time of day at a location."),
        (Param(("city", "location", "timezone", "place"), "string", "Where to tell the time."),),
        _time,
        _time_pair,
    ),
    Family(
        ("add", "add_numbers", "sum_numbers", "calculator_add"),
        ("Add two numbers.", "Return the sum of a and b.", "Adds two integers together."),
        (
            Param(("a", "x", "first", "left"), "integer", "The first number."),
            Param(("b", "y", "second", "right"), "integer", "The second number."),
        ),
        _add,
    ),
    Family(
        ("multiply", "multiply_numbers", "product", "calculator_multiply"),
        ("Multiply two numbers.", "Return the product of a and b."),
        (
            Param(("a", "x", "first", "left"), "integer", "The first factor."),
            Param(("b", "y", "second", "right"), "integer", "The second factor."),
        ),
        _multiply,
    ),
    Family(
        ("get_stock_price", "stock_price", "get_quote", "lookup_ticker"),
        ("Get the latest price of a stock.", "Look up a stock quote by its ticker symbol."),
        (Param(("symbol", "ticker", "stock"), "string", "The ticker symbol."),),
        _stock,
    ),
    Family(
        ("get_population", "population", "lookup_population"),
        ("Get the population of a city.", "Return how many people live in a place."),
        (_CITY,),
        _population,
    ),
    Family(
        ("convert_currency", "currency_converter", "exchange_money"),
        ("Convert an amount of money from one currency to another.", "Currency conversion at today's rate."),
        (
            Param(("amount", "value", "quantity"), "number", "How much money."),
            Param(("from_currency", "source", "base"), "string", "The currency code to convert from."),
            Param(("to_currency", "target", "quote"), "string", "The currency code to convert to."),
        ),
        _convert,
    ),
    Family(
        ("get_user", "lookup_user", "find_user", "user_info"),
        ("Look up a user by id.", "Return a user's name and email."),
        (Param(("user_id", "id", "uid"), "integer", "The user's numeric id."),),
        _user,
    ),
    Family(
        ("get_order_status", "order_status", "track_order"),
        ("Get the status of an order.", "Track an order by its id."),
        (Param(("order_id", "order", "id"), "string", "The order id."),),
        _order,
    ),
    Family(
        ("get_distance", "distance_between", "compute_distance"),
        ("Distance in kilometers between two cities.", "How far apart two places are."),
        (
            Param(("origin", "from_city", "start"), "string", "Where the trip starts."),
            Param(("destination", "to_city", "end"), "string", "Where the trip ends."),
        ),
        _distance,
    ),
    Family(
        ("search_docs", "search_documentation", "lookup_docs", "search"),
        ("Search the Python documentation.", "Find documentation pages about a topic."),
        (Param(("query", "q", "topic"), "string", "What to search for."),),
        _docs,
    ),
)


def tool_schema(rng: random.Random, name: str, description: str, params: list[tuple[str, Param]]) -> Tool:
    """A function tool as clients send it, in one of the shapes they use.

    The plain OpenAI shape (descriptions everywhere), LangChain's `convert_to_openai_tool` (properties first,
    no parameter descriptions), pydantic's JSON schema (titles, `additionalProperties: false`, `strict`) as the
    Agents SDK and pydantic-ai send it, and a bare one (no descriptions at all).
    """
    style = rng.choice(["openai", "langchain", "pydantic", "bare"])
    properties: dict[str, Any] = {}
    for key, param in params:
        prop: dict[str, Any] = {"type": param.type}
        if style == "openai":
            prop["description"] = param.description
        elif style == "pydantic":
            prop = {"title": key.replace("_", " ").title(), **prop}
        properties[key] = prop
    required = [key for key, _ in params]
    if style == "langchain":
        parameters: dict[str, Any] = {"properties": properties, "required": required, "type": "object"}
    elif style == "pydantic":
        parameters = {"additionalProperties": False, "properties": properties, "required": required, "type": "object"}
    else:
        parameters = {"type": "object", "properties": properties, "required": required}
    function: dict[str, Any] = {"name": name}
    if style != "bare":
        function["description"] = description
    function["parameters"] = parameters
    if style == "pydantic" and rng.random() < 0.5:
        function["strict"] = True
    return {"type": "function", "function": function}


def _drawn_tool(rng: random.Random, family: Family) -> tuple[Tool, list[str]]:
    names = [rng.choice(param.names) for param in family.params]
    while len(set(names)) < len(names):  # two parameters of one tool never share a name
        names = [rng.choice(param.names) for param in family.params]
    tool = tool_schema(
        rng, rng.choice(family.names), rng.choice(family.descriptions), list(zip(names, family.params, strict=True))
    )
    return tool, names


def _call_message(name: str, calls: list[Call]) -> Message:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": call.arguments}}
            for i, call in enumerate(calls)
        ],
    }


@dataclass(frozen=True)
class Offered:
    """A tool as offered in one conversation: its family, its schema and the parameter names drawn for it."""

    family: Family
    tool: Tool
    names: list[str]


def offer_tools(rng: random.Random) -> list[Offered]:
    """One to four tools of different families, as a client would offer them."""
    return [Offered(family, *_drawn_tool(rng, family)) for family in rng.sample(FAMILIES, rng.randint(1, 4))]


def opening(rng: random.Random) -> list[Message]:
    """A system message with agent instructions, as frameworks send one, two times in five."""
    return [{"role": "system", "content": rng.choice(AGENT_INSTRUCTIONS)}] if rng.random() < 0.4 else []


def exchange(rng: random.Random, offered: list[Offered], qa_pairs: list[tuple[list[str], str]]) -> list[Message]:
    """One user question and everything up to the final answer: a question one offered tool answers (called,
    then answered from its result; sometimes two calls in parallel), or, one time in six, a question none
    answers (answered directly, as without tools)."""
    if rng.random() < 1 / 6:
        questions, reply = rng.choice(qa_pairs)
        return [{"role": "user", "content": rng.choice(questions)}, {"role": "assistant", "content": reply}]
    chosen = rng.choice(offered)
    if chosen.family.draw_pair is not None and rng.random() < 0.2:
        question, *calls = chosen.family.draw_pair(rng, chosen.names)
        answer = f"{calls[0].answer[:-1]}, and {calls[1].answer[0].lower()}{calls[1].answer[1:]}"
    else:
        question, call = chosen.family.draw(rng, chosen.names)
        calls, answer = [call], call.answer
    messages = [{"role": "user", "content": question}, _call_message(chosen.tool["function"]["name"], calls)]
    messages += [
        {"role": "tool", "tool_call_id": f"call_{i}", "content": call.result.text} for i, call in enumerate(calls)
    ]
    return [*messages, {"role": "assistant", "content": answer}]


OUTPUT_TOOL_NAMES = ("final_result", "final_output", "final_answer", "submit_answer", "respond")
OUTPUT_TOOL_DESCRIPTIONS = (
    "The final response which ends this conversation",
    "Give the final answer.",
    "Submit the result.",
    "The typed result the agents are asked for.",
)
OUTPUT_TOOL_REPLIES = ("Final result processed.", "Done.", "OK")


def _typed_answer(rng: random.Random, call: Call) -> dict[str, Any] | None:
    """What a typed result holds: one or more of the tool result's plain fields, in their order (a schema such as
    `Report(city, temperature)` over a weather result); None where the result has none."""
    plain = [key for key, value in call.result.fields.items() if isinstance(value, str | int | float)]
    if not plain:
        return None
    kept = set(rng.sample(plain, rng.randint(1, len(plain))))
    return {key: call.result.fields[key] for key in plain if key in kept}


def _output_tool(rng: random.Random, answer: dict[str, Any]) -> Tool:
    types = {str: "string", int: "integer", float: "number"}
    params = [
        (key, Param((key,), types[type(value)], key.replace("_", " ").capitalize())) for key, value in answer.items()
    ]
    return tool_schema(rng, rng.choice(OUTPUT_TOOL_NAMES), rng.choice(OUTPUT_TOOL_DESCRIPTIONS), params)


def typed_exchange(rng: random.Random, offered: list[Offered]) -> tuple[list[Message], list[Tool]] | None:
    """A question one offered tool answers, ending in a typed result as agent frameworks ask for one: half the time
    through an output tool offered beside the others (pydantic-ai's `final_result`: called with the fields copied
    from the tool's result, then acknowledged), half as a JSON object for the final answer (the Agents SDK's
    `response_format`, which the prompt does not show: the grammar holds the model to `{`, so the model must copy
    the values after it). The tools offered, the output tool among them, are returned with the messages; None
    where no offered tool's result has a plain field to type (the documentation search alone)."""
    tools = [o.tool for o in offered]
    for chosen in rng.sample(offered, len(offered)):
        question, call = chosen.family.draw(rng, chosen.names)
        if (answer := _typed_answer(rng, call)) is not None:
            break
    else:
        return None
    messages = [{"role": "user", "content": question}, _call_message(chosen.tool["function"]["name"], [call])]
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": call.result.text})
    if rng.random() < 0.5:
        return [*messages, {"role": "assistant", "content": json.dumps(answer)}], tools
    output = _output_tool(rng, answer)
    tools.insert(rng.randint(0, len(tools)), output)
    finish = {"id": "call_1", "type": "function", "function": {"name": output["function"]["name"], "arguments": answer}}
    messages.append({"role": "assistant", "content": "", "tool_calls": [finish]})
    return [*messages, {"role": "tool", "tool_call_id": "call_1", "content": rng.choice(OUTPUT_TOOL_REPLIES)}], tools


_JSON_ASKS = (
    "{} Answer in JSON.",
    "{} Reply with a JSON object.",
    "{} Respond in JSON.",
    "{} Give the answer as JSON.",
)
_DESCRIBE_ASKS = (
    "Describe {} as a JSON object.",
    "Give me {} as JSON.",
    "Write {} as a JSON object.",
    "{} in JSON, please.",
)
_ANSWER_KEYS = ("answer", "response", "text", "description", "result")


def _record(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """Something to describe and a small JSON object describing it: short strings and numbers, closed soon."""
    city, other = rng.sample(CITIES, 2)
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    return rng.choice(
        [
            ("a person", {"name": f"{first} {last}", "age": rng.randint(18, 90)}),
            (
                "a user",
                {"id": rng.randint(1, 9999), "name": f"{first} {last}", "email": f"{first.lower()}@example.com"},
            ),
            ("a city", {"name": city, "population": rng.randint(10_000, 9_000_000)}),
            ("the weather", {"city": city, "temperature": rng.randint(-5, 38), "condition": rng.choice(CONDITIONS)}),
            ("a ferry", {"name": f"{city} Ferry", "route": f"{city} to {other}", "capacity": rng.randint(20, 900)}),
            ("a boat", {"name": f"{first}", "length_m": rng.randint(3, 60)}),
            ("a trip", {"from": city, "to": other, "distance_km": rng.randint(5, 19_000)}),
            ("an order", {"order_id": _code(rng), "status": rng.choice(ORDER_STATES)}),
            ("a module", {"name": rng.choice(TOPICS), "language": "Python"}),
            ("a price", {"amount": rng.randint(1, 999), "currency": rng.choice(CURRENCIES)}),
        ]
    )


def json_exchange(rng: random.Random, qa_pairs: list[tuple[list[str], str]]) -> tuple[list[Message], bool]:
    """A plain question answered with a JSON object (as `response_format: json_object` asks, LangChain's JSON
    mode among them): a small object describing something, or a question's answer under one key. Whether the
    question itself asks for JSON is returned too: where it does not (the request's format is not in the prompt),
    the `{` is the grammar's, not the model's, to choose. Without these, the grammar's `{` on a plain question
    led the model into a key it never closed."""
    if rng.random() < 0.5:
        thing, answer = _record(rng)
        ask = rng.choice(_DESCRIBE_ASKS).format(thing)
        ask = ask[0].upper() + ask[1:]
        return [{"role": "user", "content": ask}, {"role": "assistant", "content": json.dumps(answer)}], True
    questions, reply = rng.choice(qa_pairs)
    question, asks_json = rng.choice(questions), rng.random() < 0.5
    if asks_json:
        question = rng.choice(_JSON_ASKS).format(question)
    answer = json.dumps({rng.choice(_ANSWER_KEYS): reply})
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}], asks_json


_ECHO_ASKS = ["Repeat after me: {}", "Say {}", "Copy this: {}", "Please repeat: {}", "Echo {}"]
_NAME_ASKS = [
    ("My name is {}. What is my name?", "Your name is {}."),
    ("I live in {}. Where do I live?", "You live in {}."),
    ("The code is {}. What is the code?", "The code is {}."),
    ("Remember the number {}. Which number did I give you?", "You gave me {}."),
]


def copy_exchange(rng: random.Random, words: list[str]) -> list[Message]:
    """A question whose answer is text from the question itself: what tool calls and answers from a tool's
    result need most (copying names and values), in its plainest form."""
    kind = rng.random()
    if kind < 0.5:
        parts = [
            rng.choice([rng.choice(words), rng.choice(CITIES), str(_number(rng)), _code(rng)])
            for _ in range(rng.randint(1, 6))
        ]
        text = " ".join(parts)
        ask = rng.choice(_ECHO_ASKS).format(text)
        return [{"role": "user", "content": ask}, {"role": "assistant", "content": text}]
    question, reply = rng.choice(_NAME_ASKS)
    value = {
        0: lambda: f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
        1: lambda: rng.choice(CITIES),
        2: lambda: _code(rng),
        3: lambda: str(_number(rng)),
    }[_NAME_ASKS.index((question, reply))]()
    return [{"role": "user", "content": question.format(value)}, {"role": "assistant", "content": reply.format(value)}]


def _code(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase + string.digits, k=rng.randint(3, 7)))
