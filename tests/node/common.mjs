// What the client scripts share: their command line, the question, the one tool and its
// implementation, and the summary they print for tests/gateway/test_node_clients.py.

export const ASK = "What is the weather like in Paris?";
export const CITIES = ["Paris", "Oslo"];
/** The tool's parameters: a closed set, so any call the constraint allows is checkable. */
export const PARAMETERS = {
  type: "object",
  properties: { city: { type: "string", enum: CITIES } },
  required: ["city"],
  additionalProperties: false,
};

/** `node SCRIPT MODE BASE_URL MODEL`: the variant to run and the fleet to run it against. */
export function commandLine(modes) {
  const [mode, baseURL, model] = process.argv.slice(2);
  if (!modes.includes(mode) || !baseURL || !model) {
    throw new Error(`usage: node ${process.argv[1]} {${modes.join("|")}} BASE_URL MODEL`);
  }
  return { mode, baseURL, model };
}

/** The tool itself: every run is recorded, so the test sees what the SDK executed. */
export function weather(ran, args) {
  ran.push(args);
  return `18 C in ${args.city}`;
}

/** The summary on stdout, one JSON line: `ran` (the tool's arguments, run by run) and each
 * turn's response id, finish reason, calls and text. */
export function report(ran, turns) {
  process.stdout.write(JSON.stringify({ ran, turns }) + "\n");
}
