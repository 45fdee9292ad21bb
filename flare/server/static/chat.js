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
// Whether the conversation keeps its newest line in view: true while the reader is at the bottom,
// false once they scroll up on purpose, so that streaming text never pulls them away from what they read.
let following = true;
const FOLLOW_SLACK_PX = 24; // this close to the bottom still counts as at the bottom
let lastScrollTop = 0;

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

// The daemon this page came from, for messages that say it cannot be reached.
function daemonAddress() {
  return new URL(".", document.baseURI).href;
}

const WHAT_TO_CHECK =
  "is `flare run` still running? Check `flare ctl status` or the service's journal (`journalctl -u flare`).";

// fetch rejects (no HTTP answer at all): the daemon is stopped, restarting, or the network is down.
function unreachableText() {
  return "Cannot reach the flare daemon at " + daemonAddress() + ": " + WHAT_TO_CHECK;
}

// The answer's stream broke after it began: the daemon stopped or the connection dropped.
function lostText(error) {
  return "The connection to the flare daemon was lost mid-answer (" + error.message + "); the answer above is cut " +
    "short. " + WHAT_TO_CHECK.charAt(0).toUpperCase() + WHAT_TO_CHECK.slice(1);
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

// The model's name, shown in the header; on failure, why it could not be had.
async function loadModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (response.status === 401) {
      elements.model.textContent = "needs an API key";
      askForKey();
      return "This server needs an API key.";
    }
    if (!response.ok) {
      elements.model.textContent = await errorText(response);
      return elements.model.textContent;
    }
    modelName = (await response.json()).data[0].id;
    elements.model.textContent = modelName;
    return null;
  } catch (error) {
    elements.model.textContent = "daemon not reachable";
    return unreachableText();
  }
}

// Called after each change to the conversation, the status line under an answer included.
function keepLastLineInView() {
  const area = elements.conversation;
  if (following) area.scrollTop = area.scrollHeight;
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
  keepLastLineInView();
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
  keepLastLineInView();
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
  keepLastLineInView();
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
// A body that ends before `[DONE]` was cut off (the daemon went away mid-answer).
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the stream ended before its last event");
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
  if (!modelName) {
    const problem = await loadModel();
    if (problem) {
      following = true;
      addError(problem);
      return;
    }
  }
  elements.prompt.value = "";
  following = true; // the reader's own question brings the view back down to the conversation's end
  addTurn("user", text);
  history.push({ role: "user", content: text });
  const conversation = conversationNumber;
  const controller = new AbortController();
  setRunning(controller);
  let turn = null; // the answer's element, once the server accepted the question
  let answer = "";
  try {
    let response;
    try {
      response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: headers(),
        body: JSON.stringify(requestBody()),
        signal: controller.signal,
      });
    } catch (error) {
      if (error.name !== "AbortError") {
        addError(unreachableText());
        // Asked again on the next send, which then says at once whether the daemon is back.
        modelName = null;
        elements.model.textContent = "daemon not reachable";
        // The question never reached the daemon: it goes back in the box, ready to send again.
        if (elements.prompt.value === "") elements.prompt.value = text;
        return;
      }
      throw error;
    }
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
          keepLastLineInView();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    if (finish === "length") setStatus(turn, "stopped at the max tokens limit");
  } catch (error) {
    if (error.name === "AbortError") {
      if (turn) setStatus(turn, "stopped");
    } else if (error instanceof SyntaxError) {
      addError("The answer could not be read (" + error.message + ").");
    } else if (turn) {
      addError(lostText(error));
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
elements.conversation.addEventListener("scroll", () => {
  const area = elements.conversation;
  const atBottom = area.scrollHeight - area.scrollTop - area.clientHeight <= FOLLOW_SLACK_PX;
  // Only a move up (the reader's own) stops following: text added since the page's own scroll is not one.
  following = atBottom || (following && area.scrollTop >= lastScrollTop);
  lastScrollTop = area.scrollTop;
});
// A scroll event arrives a frame after the move: text streamed in meanwhile would scroll the view
// back down first, and the move would be lost. The reader's intent to read upward (the wheel,
// a touch, the keys that scroll up) stops following at once; reaching the bottom resumes it.
const UPWARD_KEYS = new Set(["ArrowUp", "PageUp", "Home"]);
elements.conversation.addEventListener("wheel", (event) => {
  if (event.deltaY < 0) following = false;
}, { passive: true });
elements.conversation.addEventListener("touchmove", () => {
  following = false;
}, { passive: true });
elements.conversation.addEventListener("keydown", (event) => {
  if (UPWARD_KEYS.has(event.key)) following = false;
});
elements.send.addEventListener("click", send);
elements.stop.addEventListener("click", () => running && running.abort());
elements.newChat.addEventListener("click", () => {
  if (running) running.abort();
  conversationNumber += 1;
  history.length = 0;
  elements.conversation.replaceChildren();
  following = true;
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
