// A two-turn tool loop through the Node `openai` SDK, on chat completions or the Responses
// API, whole or streamed (the SDK's stream helpers assemble the calls from their deltas).
// Turn 1 must call the tool (tool_choice "required"); its result goes back as the next
// turn's input and turn 2 must answer in text (tool_choice "none", the tools still offered).

import OpenAI from "openai";

import { ASK, PARAMETERS, commandLine, report, weather } from "./common.mjs";

const { mode, baseURL, model } = commandLine(
  ["chat", "chat-stream", "responses", "responses-stream"]);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 60_000 });
const streamed = mode.endsWith("-stream");
const ran = [];

/** A reply's message or output items as the next request's input. The stream helpers
 * annotate what they assemble (`parsed`, `parsed_arguments`): fields of the SDK, not of the
 * API's input, which this gateway refuses by name; the SDK's own `runTools` drops them the
 * same way before it sends a message back. */
function asInput(value) {
  return JSON.parse(JSON.stringify(value, (key, v) =>
    key === "parsed" || key === "parsed_arguments" ? undefined : v));
}

async function chatTurn(body) {
  const completion = streamed
    ? await client.chat.completions.stream(body).finalChatCompletion()
    : await client.chat.completions.create(body);
  const [choice] = completion.choices;
  return { completion, message: choice.message, finish: choice.finish_reason };
}

async function chatLoop() {
  const tools = [{ type: "function", function: {
    name: "get_weather", description: "The weather now in a city", parameters: PARAMETERS } }];
  const messages = [{ role: "user", content: ASK }];
  const base = { model, tools, temperature: 0, max_tokens: 120 };
  const first = await chatTurn({ ...base, messages, tool_choice: "required",
                                 parallel_tool_calls: false });
  messages.push(asInput(first.message));
  for (const call of first.message.tool_calls ?? []) {
    messages.push({ role: "tool", tool_call_id: call.id,
                    content: weather(ran, JSON.parse(call.function.arguments)) });
  }
  const second = await chatTurn({ ...base, messages, tool_choice: "none", max_tokens: 24 });
  return [first, second].map(({ completion, message, finish }) => ({
    id: completion.id, finish, text: message.content ?? "",
    calls: (message.tool_calls ?? []).map((c) => ({
      id: c.id, name: c.function.name, arguments: c.function.arguments })) }));
}

async function responsesTurn(body) {
  return streamed
    ? await client.responses.stream(body).finalResponse()
    : await client.responses.create(body);
}

async function responsesLoop() {
  const tools = [{ type: "function", name: "get_weather", description: "The weather now in a city",
                   parameters: PARAMETERS, strict: true }];
  const input = [{ role: "user", content: ASK }];
  const base = { model, tools, temperature: 0, max_output_tokens: 120 };
  const first = await responsesTurn({ ...base, input, tool_choice: "required",
                                      parallel_tool_calls: false });
  input.push(...asInput(first.output));
  for (const item of first.output.filter((i) => i.type === "function_call")) {
    input.push({ type: "function_call_output", call_id: item.call_id,
                 output: weather(ran, JSON.parse(item.arguments)) });
  }
  const second = await responsesTurn({ ...base, input, tool_choice: "none",
                                       max_output_tokens: 24 });
  return [first, second].map((response) => ({
    id: response.id, finish: response.status, text: response.output_text,
    calls: response.output.filter((i) => i.type === "function_call").map((c) => ({
      id: c.call_id, name: c.name, arguments: c.arguments })) }));
}

report(ran, await (mode.startsWith("chat") ? chatLoop() : responsesLoop()));
