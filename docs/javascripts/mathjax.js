// MathJax 3 (its SVG build, tex-svg.js) for pymdownx.arithmatex (generic mode): typeset only what
// arithmatex marked, and again when Material for MkDocs swaps in a page without reloading.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    // Before MathJax has loaded, window.MathJax is the configuration above: its own start-up
    // typesets the page.
    if (!window.MathJax || !MathJax.startup || !MathJax.startup.promise) {
      return;
    }
    MathJax.startup.promise = MathJax.startup.promise.then(() => {
      // The SVG output (MathJax 3.2) keeps its glyphs in a font cache: clearFontCache(); the
      // CHTML output has clearCache() instead, which the SVG output lacks.
      const output = MathJax.startup.output;
      if (typeof output.clearFontCache === "function") {
        output.clearFontCache();
      } else if (typeof output.clearCache === "function") {
        output.clearCache();
      }
      MathJax.typesetClear();
      MathJax.texReset();
      return MathJax.typesetPromise();
    });
  });
}
