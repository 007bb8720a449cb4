// Live refresh for the findings page: re-fetch the server-rendered part every 5 s while "live" is ticked
// and the tab is visible. The server escapes everything; this script only swaps its HTML in.
(() => {
  const part = document.getElementById("live-part");
  const box = document.getElementById("live");
  const stamp = document.getElementById("refreshed");
  if (!part) return;
  setInterval(async () => {
    if ((box && !box.checked) || document.hidden) return;
    try {
      const answer = await fetch(part.dataset.live, {credentials: "same-origin", cache: "no-store"});
      if (!answer.ok) return;
      part.innerHTML = await answer.text();
      if (stamp) stamp.textContent = "refreshed " + new Date().toLocaleTimeString();
    } catch (_) {
      if (stamp) stamp.textContent = "refresh failed; retrying";
    }
  }, 5000);
})();
