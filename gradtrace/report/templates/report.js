// The search box of the training-example index: optional (the page is complete without it). It reads text
// from the page and sets attributes; it writes no markup. "#find=TERM" in the address searches on opening.
(function () {
  "use strict";
  var box = document.getElementById("find"), found = document.getElementById("found");
  var rows = Array.prototype.slice.call(document.querySelectorAll("#train .te"));
  if (!box || !found || !rows.length) { return; }
  var ids = {}, keys = {};
  rows.forEach(function (row) {
    ids[row.id] = row.querySelector(".tid").textContent.toLowerCase();
    keys[row.id] = row.cells[0].textContent.toLowerCase();
  });
  // the full texts shown in the ranked lists of the query pages (the index holds their first characters)
  var read = {};
  Array.prototype.forEach.call(document.querySelectorAll("a.tl"), function (link) {
    var anchor = link.getAttribute("href").slice(1), item = link.closest("li"), text = item && item.querySelector(".tx");
    if (keys[anchor] !== undefined && text && !read[anchor]) {
      keys[anchor] += " " + text.textContent.toLowerCase();
      read[anchor] = true;
    }
  });
  function search(term) {
    term = term.trim().toLowerCase();
    var count = 0;
    rows.forEach(function (row) {
      var hit = !term || keys[row.id].indexOf(term) >= 0;
      row.hidden = !hit;
      row.classList.toggle("exact", term !== "" && ids[row.id] === term);
      count += hit ? 1 : 0;
    });
    found.hidden = !term;
    found.textContent = count + " of " + rows.length + " training examples match \u201c" + term + "\u201d";
    if (term && location.hash !== "#train") { location.hash = "train"; }
  }
  box.hidden = false;
  box.addEventListener("input", function () { search(box.value); });
  if (location.hash.indexOf("#find=") === 0) {
    box.value = decodeURIComponent(location.hash.slice(6));
    search(box.value);
  }
}());
