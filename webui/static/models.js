// Models: fills in each row's memory plan as the console computes it (GET /api/models/fits) and
// follows the downloads (GET /api/models/pulls): progress bars, status, and a reload once one
// ends, so the rows show what is installed now.
(function () {
  "use strict";

  function mib(bytes) { return (bytes / 1048576).toFixed(1) + " MiB"; }

  function byteText(done, total) {
    if (!total) return "";
    const percent = Math.floor((100 * done) / total);
    return mib(done) + " of " + mib(total) + " (" + percent + "%)";
  }

  async function fetchJson(path) {
    const response = await fetch(path, { credentials: "same-origin" });
    return response.ok ? response.json() : null;
  }

  function rowsChecking() {
    return document.querySelectorAll('tr[data-candidate][data-fits="checking"]');
  }

  function renderFit(row, fit) {
    row.dataset.fits = fit.fits;
    const cell = row.querySelector("td.fit");
    if (cell) {
      cell.textContent = fit.text;
      cell.title = fit.summary;
      cell.className = "fit fit-" + fit.fits;
    }
    const size = row.querySelector("td.size");
    if (size && fit.size) size.textContent = fit.size;
    const quantization = row.querySelector("td.quantization");
    if (quantization && fit.quantization) quantization.textContent = fit.quantization;
  }

  async function pollFits() {
    if (rowsChecking().length === 0) return;
    try {
      const body = await fetchJson("/api/models/fits");
      if (body) {
        document.querySelectorAll("tr[data-candidate]").forEach(function (row) {
          const fit = body.rows[row.dataset.candidate];
          if (fit) renderFit(row, fit);
        });
      }
    } catch (err) {
      // the console is restarting or unreachable: try again
    }
    if (rowsChecking().length > 0) window.setTimeout(pollFits, 2000);
  }

  function renderPull(job) {
    const row = document.getElementById("pull-" + job.slug);
    if (!row) return false;
    const bar = document.getElementById("pull-progress-" + job.slug);
    if (bar && job.bytes_total) {
      bar.max = job.bytes_total;
      bar.value = job.bytes_done;
    }
    const status = document.getElementById("pull-status-" + job.slug);
    if (status) {
      let text = job.phase;
      if (job.running) {
        text += " " + byteText(job.bytes_done, job.bytes_total);
        if (job.files_total) text += ", " + job.files_done + " of " + job.files_total + " files";
      } else if (job.message) {
        text += ": " + job.message;
      }
      status.textContent = text;
    }
    row.dataset.phase = job.phase;
    const wasRunning = row.dataset.running === "true";
    row.dataset.running = job.running ? "true" : "false";
    return wasRunning && !job.running;
  }

  async function pollPulls() {
    if (!document.querySelector('#pulls tr[data-running="true"]')) return;
    try {
      const body = await fetchJson("/api/models/pulls");
      if (body) {
        let ended = false;
        body.pulls.forEach(function (job) { ended = renderPull(job) || ended; });
        if (ended) {
          window.setTimeout(function () { window.location.reload(); }, 1500);
          return;
        }
      }
    } catch (err) {
      // as above
    }
    window.setTimeout(pollPulls, 1000);
  }

  pollFits();
  pollPulls();
})();
