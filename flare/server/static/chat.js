// The chat page: streams answers from v1/chat/completions (server-sent events read through
// fetch and a ReadableStream). Every URL is relative, so the page works behind a reverse proxy
// under any path; it loads nothing from elsewhere. Model text is only ever set as textContent.
"use strict";

const KEY_STORAGE = "flare.apiKey";
const elements = {
  model: document.getElementById("model"),
  temperature: document.getElementById("temperature"),
  maxTokens: document.getElementById("max-tokens"),
  newChat: document.getElementById("new-chat"),
  keyPanel: document.getElementById("key-panel"),
  apiKey: document.getElementById("api-key"),
  saveKey: document.getElementById("save-key"),
  conversation: document.getElementById("conversation"),
  prompt: document.getElementById("prompt"),
  send: document.getElementById("send"),
  stop: document.getElementById("stop"),
};
// The conversation sent with each request: {role, content} messages, answers included.
const history = [];
let modelName = null;
let running = null; // the AbortController of the answer streaming now
let conversationNumber = 0; // New chat starts another: an answer still ending is not added to it

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) result.Authorization = "Bearer " + key;
  return result;
}

function askForKey() {
  elements.keyPanel.hidden = false;
  elements.apiKey.focus();
}

// An API error body ({"error": {message, param, code}}) as one line for the user.
async function errorText(response) {
  let detail = response.statusText;
  try {
    const body = await response.json();
    if (body && body.error) {
      detail = body.error.message + (body.error.param ? " (" + body.error.param + ")" : "");
    }
  } catch (ignored) { /* not JSON: the status text says enough */ }
  if (response.status === 429) {
    const retry = response.headers.get("Retry-After");
    return "The server is busy: " + detail + (retry ? " Try again in " + retry + " s." : "");
  }
  return "HTTP " + response.status + ": " + detail;
}

async function loadModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (response.status === 401) {
      elements.model.textContent = "needs an API key";
      askForKey();
      return;
    }
    if (!response.ok) {
      elements.model.textContent = await errorText(response);
      return;
    }
    modelName = (await response.json()).data[0].id;
    elements.model.textContent = modelName;
  } catch (error) {
    elements.model.textContent = "not reachable (" + error.message + ")";
  }
}

function addTurn(role, text) {
  const hint = elements.conversation.querySelector(".hint");
  if (hint) hint.remove();
  const turn = document.createElement("div");
  turn.className = "turn " + role;
  const body = document.createElement("p");
  body.className = "text";
  body.textContent = text;
  turn.appendChild(body);
  elements.conversation.appendChild(turn);
  turn.scrollIntoView({ block: "end" });
  return turn;
}

function addError(message) {
  const turn = addTurn("error", message);
  turn.setAttribute("role", "alert");
  return turn;
}

function setStatus(turn, text) {
  let status = turn.querySelector(".status");
  if (!status) {
    status = document.createElement("div");
    status.className = "status";
    turn.appendChild(status);
  }
  status.textContent = text;
}

// What the package policy applied to this answer (the response's `flare` object).
function showFlare(turn, flare) {
  const details = document.createElement("details");
  details.className = "flare";
  const summary = document.createElement("summary");
  const adjusted = flare.adjusted || [];
  summary.textContent = adjusted.length
    ? "sampling applied, " + adjusted.length + " adjusted by the package policy"
    : "sampling applied";
  details.appendChild(summary);
  const table = document.createElement("table");
  for (const [name, value] of Object.entries(flare.sampling || {})) {
    const row = table.insertRow();
    row.insertCell().textContent = name;
    row.insertCell().textContent = JSON.stringify(value);
  }
  for (const change of adjusted) {
    const row = table.insertRow();
    row.className = "adjusted";
    row.insertCell().textContent = change.param;
    row.insertCell().textContent =
      JSON.stringify(change.requested) + " → " + JSON.stringify(change.applied) + ": " + change.reason;
  }
  details.appendChild(table);
  turn.appendChild(details);
}

function requestBody() {
  const body = { model: modelName || "", messages: history.slice(), stream: true };
  const temperature = elements.temperature.value.trim();
  const maxTokens = elements.maxTokens.value.trim();
  // Sent as typed: the server says why a value is refused, and the page shows it.
  if (temperature !== "") body.temperature = Number(temperature);
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  return body;
}

// Server-sent events: `data: <json>` lines, events separated by a blank line, `data: [DONE]` last.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function setRunning(controller) {
  running = controller;
  elements.send.hidden = controller !== null;
  elements.stop.hidden = controller === null;
  elements.prompt.disabled = controller !== null;
  if (controller === null) elements.prompt.focus();
}

async function send() {
  const text = elements.prompt.value;
  if (running || text.trim() === "") return;
  if (!modelName) await loadModel();
  if (!modelName) return;
  elements.prompt.value = "";
  addTurn("user", text);
  history.push({ role: "user", content: text });
  const conversation = conversationNumber;
  const controller = new AbortController();
  setRunning(controller);
  let turn = null; // the answer's element, once the server accepted the question
  let answer = "";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) {
      if (response.status === 401) askForKey();
      addError(await errorText(response));
      return;
    }
    turn = addTurn("assistant streaming", "");
    const textNode = turn.querySelector(".text");
    let finish = null;
    for await (const chunk of events(response)) {
      if (chunk.error) {
        addError("The answer failed: " + chunk.error.message);
        break;
      }
      if (chunk.flare && chunk.flare.sampling) showFlare(turn, chunk.flare);
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          textNode.textContent = answer;
          turn.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    if (finish === "length") setStatus(turn, "stopped at the max tokens limit");
  } catch (error) {
    if (error.name === "AbortError") {
      if (turn) setStatus(turn, "stopped");
    } else {
      addError("The request failed: " + error.message);
    }
  } finally {
    if (turn) turn.classList.remove("streaming");
    if (conversation === conversationNumber) {
      // An answer, even a stopped one, is part of the conversation; a refused question is not.
      if (turn) history.push({ role: "assistant", content: answer });
      else history.pop();
    }
    setRunning(null);
  }
}

elements.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
elements.send.addEventListener("click", send);
elements.stop.addEventListener("click", () => running && running.abort());
elements.newChat.addEventListener("click", () => {
  if (running) running.abort();
  conversationNumber += 1;
  history.length = 0;
  elements.conversation.replaceChildren();
});
elements.saveKey.addEventListener("click", () => {
  const key = elements.apiKey.value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  elements.apiKey.value = "";
  elements.keyPanel.hidden = true;
  loadModel();
});
elements.apiKey.addEventListener("keydown", (event) => {
  if (event.key === "Enter") elements.saveKey.click();
});
loadModel();
