// Live pages: every few seconds fetch this same URL (filters included) and swap in the fresh
// content of each element marked data-live (matched by id). The rest of the page (filter
// inputs, scroll position) stays as it is. Pauses while the tab is hidden, while an element
// inside a region has focus, while a box in one is checked (a refresh would drop the selected
// rows that newer ones pushed off the page, and a bulk action would then miss them), and when
// the user switches it off.
// Relative ages ("12 s ago") of <time data-age> elements tick every second in between.
(function () {
  "use strict";
  var script = document.currentScript;
  var intervalS = Number(script && script.dataset.interval) || 5;
  var paused = false;
  var busy = false;

  function age(seconds) {
    var size = Math.abs(seconds), units = [["d", 86400], ["h", 3600], ["min", 60]], text = null;
    for (var i = 0; i < units.length && text === null; i++) {
      if (size >= units[i][1]) text = Math.floor(size / units[i][1]) + " " + units[i][0];
    }
    if (text === null) text = Math.floor(size) + " s";
    return seconds >= 0 ? text + " ago" : "in " + text;
  }

  function tickAges() {
    var now = Date.now();
    document.querySelectorAll("time[data-age]").forEach(function (el) {
      var at = Date.parse(el.getAttribute("datetime"));
      var span = el.querySelector(".tasks-age");
      if (!isNaN(at) && span) span.textContent = age((now - at) / 1000);
    });
  }

  function swap(fresh) {
    if (fresh.querySelector("[data-live-done]") && !document.querySelector("[data-live-done]")) {
      window.location.reload();  // finished: the whole page has more to show (the error, the result)
      return;
    }
    document.querySelectorAll("[data-live]").forEach(function (region) {
      var replacement = fresh.getElementById(region.id);
      if (!replacement || region.contains(document.activeElement) && document.activeElement !== document.body) return;
      region.innerHTML = replacement.innerHTML;
    });
    if (fresh.querySelector("[data-live-done]")) paused = true;  // e.g. the task finished
    document.dispatchEvent(new CustomEvent("tasks:refreshed"));
  }

  function note(text) {
    var element = document.getElementById("tasks-live-note");
    if (element) element.textContent = text;
  }

  function refresh() {
    if (paused || busy || document.hidden) return;
    if (document.querySelector("[data-live] input[type=checkbox]:checked")) {
      note(" · held while tasks are selected");
      return;
    }
    busy = true;
    fetch(window.location.href, {credentials: "same-origin", headers: {"X-Requested-With": "live"}})
      .then(function (response) {
        // The stamp says when the page last showed fresh data: a failed refresh leaves it and says why.
        if (response.redirected) throw new Error("signed out: reload the page to sign in again");
        if (!response.ok) throw new Error("the server answered " + response.status + "; trying again");
        return response.text();
      })
      .then(function (html) {
        swap(new DOMParser().parseFromString(html, "text/html"));
        var stamp = document.getElementById("tasks-live-stamp");
        if (stamp) stamp.textContent = new Date().toLocaleTimeString();
        note("");
      }, function (error) {
        note(" · not updated since: " + (error instanceof TypeError ? "the server did not answer; trying again" : error.message));
      })
      .finally(function () { busy = false; });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var toggle = document.getElementById("tasks-live-toggle");
    if (document.querySelector("[data-live-done]")) paused = true;
    if (toggle) {
      toggle.addEventListener("click", function () {
        paused = !paused;
        toggle.textContent = paused ? "Resume live updates" : "Pause live updates";
        if (!paused) refresh();
      });
      toggle.textContent = paused ? "Resume live updates" : "Pause live updates";
    }
    // Listened for on the document: a refresh replaces the select-all box with a fresh one.
    document.addEventListener("change", function (event) {
      var all = event.target;
      if (all.id !== "tasks-select-all") return;
      document.querySelectorAll("input[name=task]").forEach(function (box) { box.checked = all.checked; });
    });
    window.setInterval(refresh, intervalS * 1000);
    window.setInterval(tickAges, 1000);
  });
})();
