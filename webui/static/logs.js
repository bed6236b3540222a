// Logs: keeps the tail fresh while "follow" is ticked (the current run only: earlier runs do not
// grow), searches as the query is typed (the server filters the lines; the matches are marked
// here), and reloads the page when the rank or the run changes (each rank lists its own runs).
(function () {
  "use strict";
  const pre = document.getElementById("log-text");
  const follow = document.getElementById("follow");
  const search = document.getElementById("log-search");
  const count = document.getElementById("log-count");
  const form = document.getElementById("log-form");
  let typing = null;

  // The text with each case-insensitive occurrence of `query` in a <mark>; built from text
  // nodes, so nothing in a log line is ever parsed as markup.
  function show(text, query) {
    const lower = text.toLowerCase();
    const needle = query.toLowerCase();
    pre.replaceChildren();
    if (!needle || lower.length !== text.length) {
      pre.textContent = text;
      return;
    }
    let at = 0;
    for (let hit = lower.indexOf(needle); hit !== -1; hit = lower.indexOf(needle, at)) {
      if (hit > at) pre.appendChild(document.createTextNode(text.slice(at, hit)));
      const mark = document.createElement("mark");
      mark.textContent = text.slice(hit, hit + needle.length);
      pre.appendChild(mark);
      at = hit + needle.length;
    }
    if (at < text.length) pre.appendChild(document.createTextNode(text.slice(at)));
  }

  function showCount(body) {
    count.hidden = !body.q;
    count.textContent = body.q
      ? body.matched + " of the last " + body.searched + " lines contain \u201c" + body.q + "\u201d"
      : "";
  }

  function query() {
    const params = new URLSearchParams({ lines: pre.dataset.lines });
    if (pre.dataset.run) params.set("run", pre.dataset.run);
    if (pre.dataset.q) params.set("q", pre.dataset.q);
    return params;
  }

  async function load() {
    try {
      const response = await fetch("/api/logs/" + pre.dataset.rank + "?" + query(), { credentials: "same-origin" });
      if (!response.ok) return;
      const body = await response.json();
      if (body.q !== pre.dataset.q) return; // an answer to a query typed over since
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      show(body.text, body.q);
      showCount(body);
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    } catch (err) { /* try again at the next refresh */ }
  }

  async function refresh() {
    if (follow.checked && !pre.dataset.run) await load();
    setTimeout(refresh, 2000);
  }

  search.addEventListener("input", function () {
    clearTimeout(typing);
    typing = setTimeout(function () {
      pre.dataset.q = search.value;
      const params = query();
      params.set("rank", pre.dataset.rank);
      history.replaceState(null, "", "/logs?" + params); // a reload keeps the query
      load();
    }, 300);
  });
  for (const id of ["rank", "log-run"]) {
    document.getElementById(id).addEventListener("change", function () { form.submit(); });
  }

  show(pre.textContent, pre.dataset.q);
  pre.scrollTop = pre.scrollHeight;
  setTimeout(refresh, 2000);
})();
