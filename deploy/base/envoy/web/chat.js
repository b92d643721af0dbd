// kvmesh chat page: streams an answer token by token from Envoy's gRPC-JSON
// bridge (POST /v1/chat -> kvmesh.v1.Inference/Chat, one `data: {...}` SSE
// event per GenerateEvent). fetch, not EventSource: it can send the API key
// in the Authorization header (never in the URL, where it would reach logs)
// and it can be aborted, which cancels the request in the mesh.
// A stream that drops (its gateway died, the network blinked) resumes by
// itself: the same request again with `resume: {requestId, lastIndex}` (the
// last delta's `index`), a few times at most; the mesh continues it from the
// next delta, nothing repeated (README "Resuming a stream").
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const keyInput = $("key"), modelSelect = $("model"), maxTokens = $("max-tokens");
  const priority = $("priority"), question = $("question"), conversation = $("conversation");
  const sendButton = $("send"), stopButton = $("stop"), clearButton = $("clear"), status = $("status");

  // The conversation so far (what the model sees), and the running request.
  let history = [];
  let running = null; // {controller, stopped}
  // Resume attempts for one answer, and the wait before each (ms, times the attempt).
  const MAX_RESUMES = 5, RESUME_BACKOFF_MS = 500;

  function setStatus(state, text) {
    status.dataset.state = state;
    status.textContent = text;
  }

  function authHeaders() {
    return { Authorization: "Bearer " + keyInput.value.trim() };
  }

  // An error body from Envoy (OpenAI-style {"error": {...}}), from the
  // transcoder (google.rpc.Status {"code", "message"}) or plain text.
  async function errorText(resp) {
    const body = await resp.text();
    try {
      const data = JSON.parse(body);
      if (data.error && data.error.message) return data.error.message;
      if (data.message) return data.message;
    } catch (_) { /* not JSON */ }
    return body.trim() || resp.statusText;
  }

  async function loadModels() {
    if (!keyInput.value.trim()) return;
    try {
      const resp = await fetch("/v1/models", { headers: authHeaders() });
      if (!resp.ok) {
        setStatus("error", `Cannot list models (${resp.status}): ${await errorText(resp)}`);
        return;
      }
      const models = (await resp.json()).data || [];
      const previous = modelSelect.value;
      // /v1/models lists only the models some engine serves now, with their context length.
      const label = (m) => (m.max_model_len ? `${m.id} (${m.max_model_len} tokens)` : m.id);
      modelSelect.replaceChildren(...models.map((m) => new Option(label(m), m.id)));
      if (models.some((m) => m.id === previous)) modelSelect.value = previous;
      setStatus("idle", models.length ? "Ready." : "No model is served now (or this key may use none).");
    } catch (err) {
      setStatus("error", "Cannot reach the mesh: " + err);
    }
  }

  function addTurn(role, text) {
    const turn = document.createElement("div");
    turn.className = "turn " + role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    turn.append(who, body);
    conversation.append(turn);
    return body;
  }

  function handleEvent(event, out) {
    if (event.queued) {
      const q = event.queued;
      const wait = q.estimatedWaitSeconds ? `, about ${Math.ceil(q.estimatedWaitSeconds)} s` : "";
      // Position 0 = being placed now (an idle mesh answers so at once).
      const where = q.position ? `position ${q.position}${wait}` : "being placed";
      setStatus("queued", `Queued: ${where}.`);
      status.dataset.queuePosition = String(q.position);
    } else if (event.delta) {
      out.dataset.lastIndex = String(event.index || 0);
      out.textContent += event.delta.text || "";
      out.dataset.deltas = String(Number(out.dataset.deltas || 0) + 1);
      setStatus("generating", "Generating…");
    } else if (event.finished) {
      const f = event.finished;
      const reason = String(f.finishReason || "").replace("FINISH_REASON_", "").toLowerCase();
      const usage = f.usage || {};
      const detail = f.message ? ` (${f.message})` : "";
      setStatus(reason === "error" || reason === "timeout" ? "error" : "done",
        `Done: ${reason}${detail}; ${usage.completionTokens || 0} tokens.`);
      return true;
    }
    return false; // heartbeats keep the connection alive; nothing to show
  }

  // One attempt: POST the request (a resume when `resume` is set) and read
  // its events into `out`. True once the answer's end arrived; a dropped
  // connection returns false (or throws), an HTTP error throws.
  async function streamOnce(request, resume, out, controller) {
    const body = resume ? { ...request, resume } : request;
    const resp = await fetch("/v1/chat", {
      method: "POST",
      headers: { ...authHeaders(), "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!resp.ok) {
      const err = new Error(`${resp.status}: ${await errorText(resp)}`);
      err.status = resp.status;
      throw err;
    }
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "", finished = false;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return finished;
      buffer += value;
      // Events are separated by a blank line; keep a partial one for later.
      const parts = buffer.split("\n\n");
      buffer = parts.pop();
      for (const part of parts) {
        for (const line of part.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const event = JSON.parse(line.slice(5));
          if (event.requestId) out.dataset.requestId = event.requestId;
          finished = handleEvent(event, out) || finished;
        }
      }
    }
  }

  // The answer, resuming a dropped stream up to MAX_RESUMES times.
  async function answer(request, out, controller) {
    for (let attempt = 0; ; attempt++) {
      const resume = attempt && out.dataset.requestId
        ? { requestId: out.dataset.requestId, lastIndex: Number(out.dataset.lastIndex || 0) } : null;
      try {
        if (await streamOnce(request, resume, out, controller)) return true;
      } catch (err) {
        // A refusal (404: nothing to resume any more) or the user's Stop ends it.
        if (err.status || (running && running.stopped) || !out.dataset.requestId) throw err;
      }
      if (attempt >= MAX_RESUMES || !out.dataset.requestId) return false;
      out.dataset.resumes = String(attempt + 1);
      setStatus("resuming", `Connection lost; resuming (${attempt + 1}/${MAX_RESUMES})…`);
      await new Promise((r) => setTimeout(r, RESUME_BACKOFF_MS * (attempt + 1)));
    }
  }

  async function ask(text) {
    addTurn("user", text);
    const out = addTurn("assistant", "");
    out.dataset.deltas = "0";
    history.push({ role: "user", content: text });
    const controller = new AbortController();
    running = { controller, stopped: false };
    sendButton.disabled = true;
    stopButton.disabled = false;
    setStatus("connecting", "Sending…");
    delete status.dataset.queuePosition;
    const request = {
      model: modelSelect.value,
      messages: [...history],
      priority: priority.value,
      sampling: { maxTokens: Number(maxTokens.value) || 256 },
    };
    try {
      const finished = await answer(request, out, controller);
      if (!finished) setStatus("error", "The stream ended without an answer's end.");
      history.push({ role: "assistant", content: out.textContent });
    } catch (err) {
      if (running && running.stopped) {
        out.parentElement.classList.add("stopped");
        setStatus("stopped", "Stopped.");
        history.pop(); // the question was not answered: do not send it again
      } else {
        setStatus("error", "Request failed: " + err.message);
        history.pop();
      }
    } finally {
      running = null;
      sendButton.disabled = false;
      stopButton.disabled = true;
    }
  }

  $("ask").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = question.value.trim();
    if (!text || running) return;
    if (!keyInput.value.trim()) { setStatus("error", "Paste an API key first."); return; }
    if (!modelSelect.value) { setStatus("error", "No model: check the API key."); return; }
    question.value = "";
    ask(text);
  });
  stopButton.addEventListener("click", () => {
    // Aborting the fetch closes the connection: Envoy cancels the gRPC call,
    // the gateway cancels the request and the engine frees its blocks.
    if (running) { running.stopped = true; running.controller.abort(); }
  });
  clearButton.addEventListener("click", () => {
    if (running) return;
    history = [];
    conversation.replaceChildren();
    setStatus("idle", "New chat.");
  });
  keyInput.addEventListener("change", loadModels);
  question.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
  });
})();
