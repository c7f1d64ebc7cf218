// A two-turn tool loop through the Vercel AI SDK: `generateText` / `streamText` with one
// tool, two steps (`stopWhen: stepCountIs(2)`), on the provider's default model (the
// Responses API) or its chat-completions model. `prepareStep` makes step 1 call the tool
// (toolChoice "required") and step 2 answer in text (toolChoice "none"); the SDK runs the
// tool and sends its result between them.

import { createOpenAI } from "@ai-sdk/openai";
import { generateText, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

import { ASK, CITIES, commandLine, report, weather } from "./common.mjs";

const { mode, baseURL, model } = commandLine(
  ["responses", "responses-stream", "chat", "chat-stream"]);
const provider = createOpenAI({ baseURL, apiKey: "unused" });
const ran = [];

const options = {
  model: mode.startsWith("chat") ? provider.chat(model) : provider(model),
  prompt: ASK,
  temperature: 0,
  maxOutputTokens: 120,
  maxRetries: 0,
  tools: {
    get_weather: tool({
      description: "The weather now in a city",
      inputSchema: z.object({ city: z.enum(CITIES) }).strict(),
      execute: async (args) => weather(ran, args),
    }),
  },
  providerOptions: { openai: { parallelToolCalls: false } },
  stopWhen: stepCountIs(2),
  prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }),
};

let steps;
if (mode.endsWith("-stream")) {
  const errors = [];  // streamText reports a failed request here, not by throwing
  const result = streamText({ ...options, onError: ({ error }) => errors.push(error) });
  await result.consumeStream();
  if (errors.length) throw errors[0];
  steps = await result.steps;
} else {
  steps = (await generateText(options)).steps;
}
report(ran, steps.map((step) => ({
  id: step.response.id, finish: step.finishReason, text: step.text,
  calls: step.toolCalls.map((c) => ({ id: c.toolCallId, name: c.toolName,
                                      arguments: JSON.stringify(c.input) })) })));
