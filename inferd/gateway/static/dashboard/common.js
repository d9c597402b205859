// Shared by the server's page (app.js) and the router's (router.js): DOM helpers and the live
// overview stream, read as Server-Sent Events over fetch so an API key can ride along.
"use strict";

const $ = (sel) => document.querySelector(sel);
const el = (tag, attrs = {}, text = "") => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
};
const pct = (x) => (x === null || x === undefined ? "n/a" : (100 * x).toFixed(1) + " %");

function setConn(state, text) {
  const c = $("#conn");
  c.dataset.state = state;
  c.textContent = text;
}

// Calls onData(parsed JSON) per `data:` event of `url`, reconnecting 2 s after the stream ends;
// on a 401 calls onUnauthorized() and stops. headers() is read anew on each connect.
async function streamEvents(url, headers, onData, onUnauthorized) {
  for (;;) {
    try {
      const res = await fetch(url, { headers: headers() });
      if (res.status === 401) { onUnauthorized(); return; }
      if (!res.ok || !res.body) throw new Error(url + ": " + res.status);
      setConn("live", "live");
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (line.startsWith("data: ")) onData(JSON.parse(line.slice(6)));
          }
        }
      }
    } catch (err) {
      console.warn(err);
    }
    setConn("closed", "reconnecting…");
    await new Promise((r) => setTimeout(r, 2000));
  }
}
