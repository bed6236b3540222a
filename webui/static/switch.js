// Switch: follows the running job until it is final.
(function () {
  "use strict";
  const section = document.getElementById("job");
  if (!section || section.dataset.final === "true") return;

  function when(ts) { return new Date(ts * 1000).toLocaleTimeString(); }

  function render(job) {
    const phase = document.getElementById("job-phase");
    phase.textContent = job.phase;
    phase.className = "phase phase-" + job.phase.replace(/ /g, "-");
    const steps = document.getElementById("job-steps");
    steps.replaceChildren();
    job.steps.forEach(function (step) {
      const li = document.createElement("li");
      const at = document.createElement("span");
      at.className = "at";
      at.textContent = when(step.at);
      li.appendChild(at);
      li.appendChild(document.createTextNode(" " + step.message));
      steps.appendChild(li);
    });
    if (job.reason) {
      document.getElementById("job-failure").hidden = false;
      document.getElementById("job-reason").textContent = job.reason;
      document.getElementById("job-log").textContent = job.log_tail;
    }
    section.dataset.final = job.final ? "true" : "false";
  }

  async function poll() {
    try {
      const response = await fetch("/api/switch", { credentials: "same-origin" });
      if (response.ok) {
        const body = await response.json();
        if (body.job && String(body.job.id) === section.dataset.job) {
          render(body.job);
          if (body.job.final) return;
        }
      }
    } catch (err) { /* try again */ }
    setTimeout(poll, 1000);
  }
  setTimeout(poll, 500);
})();
