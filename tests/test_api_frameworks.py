"""Agent frameworks driving the new APIs over real HTTP: LangGraph's prebuilt ReAct agent on LangChain's ChatOpenAI
with `use_responses_api=True` (so every model call is a `/v1/responses` request with function tools)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from tinkerless.functions.apis import api_routers
from tinkerless.functions.hosting.agent_functions import bearer_token
from tinkerless.server import serve_in_thread
from tests.scripted_model import ScriptedModel

pytestmark = pytest.mark.timeout(120)


def test_a_langgraph_react_agent_runs_its_tool_loop_over_the_responses_api(worker):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculator(expression: str) -> str:
        """Evaluate arithmetic."""
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the test's own literal

    model = ScriptedModel(worker.tokenizer, [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>', "It is 21."],
        advance=True)
    app = FastAPI()
    for router in api_routers(model, caller=bearer_token):
        app.include_router(router)
    with serve_in_thread(app) as url:
        chat = ChatOpenAI(model="scripted", base_url=f"{url}/v1", api_key="episode-1", use_responses_api=True,
                          max_retries=0, timeout=60)
        agent = create_react_agent(chat, [calculator])
        result = agent.invoke({"messages": [("user", "What is 3 * 7?")]})
    kinds = [type(m).__name__ for m in result["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert result["messages"][1].tool_calls[0]["args"] == {"expression": "3 * 7"}
    assert result["messages"][2].content == "21" and result["messages"][3].text == "It is 21."
    # The second call continues the first's prompt with the call and its result, as Chat Completions renders them.
    first, second = model.prompts
    assert second[: len(first)] == first
    assert "<tool_response>21</tool_response>" in worker.tokenizer.decode(second[len(first):])
