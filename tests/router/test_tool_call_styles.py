"""A model whose template writes tool calls in DeepSeek-V3.1's style gets them through the router as OpenAI tool
calls, whole and streamed: the router reads the style from the template, its grammar makes the model write it, and its
parser reads it back."""

import json

import jsonschema
import openai
import pytest
from v3_1_template import with_v3_1_template

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.text.tool_calls import CALL_BEGIN, SEPARATOR

TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model_dir(tiny_v3_deepseek, tmp_path_factory) -> str:
    return with_v3_1_template(tiny_v3_deepseek, tmp_path_factory.mktemp("v3_1"))


@pytest.fixture(scope="module")
def client(model_dir):
    cfg = ClusterConfig(model=model_dir, port=0, num_prefill=0, num_decode=0, num_both=1,
                        worker_args=("--dtype", "float32", "--num-pages", "256"))
    with InProcessCluster(cfg) as cluster:
        yield openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_v3_1_style_calls_come_back_as_openai_tool_calls_whole_and_streamed(client, model_dir):
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Time in CET?"}], tools=[TIME_TOOL],
                  tool_choice="required", temperature=0, max_tokens=40,
                  extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**kwargs)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME_TOOL["function"]["parameters"])
    written = PromptTokenizer(model_dir).tokenizer.decode(whole.choices[0].model_extra["token_ids"],
                                                          skip_special_tokens=False)
    assert f"{CALL_BEGIN}get_time{SEPARATOR}{{" in written  # V3.1's style, not V3's `function<sep>get_time`
    arguments = "".join(d.function.arguments or "" for chunk in client.chat.completions.create(stream=True, **kwargs)
                        if chunk.choices for d in chunk.choices[0].delta.tool_calls or [])
    assert arguments == calls[0].function.arguments
    # The history renders the call in the template's style, and the model answers after its result.
    final = client.chat.completions.create(model=model, tools=[TIME_TOOL], tool_choice="none", max_tokens=5,
                                           temperature=0, messages=[*kwargs["messages"],
                                                                    whole.choices[0].message.model_dump(exclude_none=True),
                                                                    {"role": "tool", "tool_call_id": calls[0].id,
                                                                     "content": "12:00"}])
    history = whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert final.usage.prompt_tokens > history and not final.choices[0].message.tool_calls  # the result is in it
