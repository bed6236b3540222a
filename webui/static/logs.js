// Logs: keeps the tail fresh while "follow" is ticked.
(function () {
  "use strict";
  const pre = document.getElementById("log-text");
  const follow = document.getElementById("follow");

  async function refresh() {
    if (follow.checked) {
      try {
        const response = await fetch("/api/logs/" + pre.dataset.rank + "?lines=" + pre.dataset.lines, { credentials: "same-origin" });
        if (response.ok) {
          const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
          pre.textContent = (await response.json()).text;
          if (atBottom) pre.scrollTop = pre.scrollHeight;
        }
      } catch (err) { /* try again */ }
    }
    setTimeout(refresh, 2000);
  }
  pre.scrollTop = pre.scrollHeight;
  setTimeout(refresh, 2000);
})();
