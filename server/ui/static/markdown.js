// A small Markdown renderer for model output that never parses HTML.
//
// Model output is untrusted: it may contain "<script>" or "<img src=x onerror=...>", and those must show up as
// the characters they are. So nothing here assigns innerHTML: every piece of text becomes a text node, elements
// come only from document.createElement with tag names written in this file, and links keep only http(s) URLs.
//
// Supported: paragraphs (single newlines kept as line breaks), # headings, ``` and ~~~ code fences, `inline
// code`, **bold**, *italic* and _italic_, ~~strikethrough~~, - / * / + and 1. lists (nested by indentation),
// > quotes, --- rules, [links](https://...), <https://...> and bare http(s) URLs, backslash escapes.
// Unclosed fences and emphasis (a stream cut mid-answer) render as far as they go.
"use strict";

const FerryMarkdown = (() => {
  // A backtick fence's info string has no backticks ("```x```" on one line is inline code, not a fence).
  const FENCE = /^ {0,3}(`{3,}(?=[^`]*$)|~{3,})\s*([\w#+.-]*)/;
  const FENCE_CLOSE = /^ {0,3}(`{3,}|~{3,})\s*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}>\s?(.*)$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

  function el(tag, ...children) {
    const node = document.createElement(tag);
    node.append(...children); // strings become text nodes
    return node;
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function indentOf(line) {
    return line.match(/^\s*/)[0].replace(/\t/g, "    ").length;
  }

  // Remove up to `width` leading spaces (a tab counts as four).
  function dedent(line, width) {
    let i = 0;
    let removed = 0;
    while (i < line.length && removed < width && (line[i] === " " || line[i] === "\t")) {
      removed += line[i] === "\t" ? 4 : 1;
      i += 1;
    }
    return line.slice(i);
  }

  // ------------------------------------------------------------------------------------------------ blocks

  function renderBlocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i += 1;
      } else if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i += 1;
        while (i < lines.length) {
          const close = FENCE_CLOSE.exec(lines[i]);
          if (close && close[1][0] === fence[0] && close[1].length >= fence.length) break;
          body.push(lines[i]);
          i += 1;
        }
        i += 1; // the closing fence, or past the end when the stream stopped inside the block
        const code = el("code", body.join("\n"));
        if (m[2]) code.className = `language-${m[2]}`; // m[2] is [\w#+.-]* only
        parent.append(el("pre", code));
      } else if (RULE.test(line)) {
        parent.append(el("hr"));
        i += 1;
      } else if ((m = HEADING.exec(line))) {
        parent.append(el(`h${m[1].length}`, ...renderInline(m[2])));
        i += 1;
      } else if (QUOTE.test(line)) {
        const quoted = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          quoted.push(m[1]);
          i += 1;
        }
        const quote = el("blockquote");
        renderBlocks(quoted, quote);
        parent.append(quote);
      } else if (ITEM.test(line)) {
        i = renderList(lines, i, parent);
      } else {
        const paragraph = [];
        while (i < lines.length && lines[i].trim() && !(paragraph.length && startsBlock(lines[i]))) {
          paragraph.push(lines[i].trim());
          i += 1;
        }
        const p = el("p");
        paragraph.forEach((text, n) => {
          if (n) p.append(el("br"));
          p.append(...renderInline(text));
        });
        parent.append(p);
      }
    }
  }

  // One list starting at lines[start]: items of the same kind (bullets or numbers) at the same indentation.
  // An item owns the lines indented past its marker (and plain lines right after it), rendered as blocks, which
  // is how nested lists and code inside items come out. Returns the index of the first line after the list.
  function renderList(lines, start, parent) {
    const first = ITEM.exec(lines[start]);
    const ordered = /\d/.test(first[2]);
    const base = indentOf(first[1]);
    const list = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
    let i = start;
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || indentOf(m[1]) !== base || /\d/.test(m[2]) !== ordered) break;
      const width = base + m[2].length + 1;
      const content = [m[3]];
      i += 1;
      while (i < lines.length) {
        const line = lines[i];
        if (!line.trim()) {
          // A blank line continues the item only when an indented line follows it.
          const next = lines[i + 1];
          if (next !== undefined && next.trim() && indentOf(next) >= width) {
            content.push("");
            i += 1;
            continue;
          }
          break;
        }
        if (indentOf(line) >= Math.min(width, base + 2)) {
          content.push(dedent(line, width));
        } else if (!startsBlock(line) && content[content.length - 1] !== "") {
          content.push(line.trim()); // a lazy continuation of the item's text
        } else {
          break;
        }
        i += 1;
      }
      const item = el("li");
      renderBlocks(content, item);
      // A tight item (no blank line inside) holds its text directly, not in a paragraph.
      if (!content.includes("")) {
        for (const child of [...item.children]) if (child.tagName === "P") child.replaceWith(...child.childNodes);
      }
      list.append(item);
      // Blank lines between items of the same list do not end it.
      let j = i;
      while (j < lines.length && !lines[j].trim()) j += 1;
      const again = j < lines.length && ITEM.exec(lines[j]);
      if (again && indentOf(again[1]) === base && /\d/.test(again[2]) === ordered) i = j;
    }
    parent.append(list);
    return i;
  }

  // ------------------------------------------------------------------------------------------------ inline

  // An http(s) URL, normalised, or null for anything else (javascript:, data:, relative paths...).
  function safeHref(raw) {
    try {
      const url = new URL(raw);
      return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
    } catch {
      return null;
    }
  }

  function link(href, children) {
    const a = el("a", ...children);
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    return a;
  }

  // Each rule: a pattern, and what its earliest match becomes (an array of nodes). Earlier rules win ties.
  const INLINE_RULES = [
    { re: /\\([\\`*_{}[\]()#+\-.!~>|])/, make: (m) => [m[1]] },
    { re: /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/, make: (m) => [el("code", m[2].replace(/^ (.+) $/, "$1"))] },
    {
      re: /\[([^\]\n]+)\]\(\s*<?([^\s<>()]+)>?(?:\s+"[^"\n]*")?\s*\)/,
      make: (m, inLink) => {
        const href = safeHref(m[2]);
        if (!href || inLink) return [m[0]]; // shown as the text it was
        return [link(href, renderInline(m[1], true))];
      },
    },
    {
      re: /<(https?:\/\/[^\s<>]+)>/,
      make: (m, inLink) => {
        const href = safeHref(m[1]);
        return href && !inLink ? [link(href, [m[1]])] : [m[0]];
      },
    },
    {
      // Trailing punctuation is rarely part of a URL in prose: "see https://example.com." ends at "com".
      re: /\bhttps?:\/\/[^\s<>()[\]]*[^\s<>()[\].,;:!?'"*_~]/,
      make: (m, inLink) => {
        const href = safeHref(m[0]);
        return href && !inLink ? [link(href, [m[0]])] : [m[0]];
      },
    },
    { re: /\*\*(?=\S)([\s\S]*?\S)\*\*/, make: (m, inLink) => [el("strong", ...renderInline(m[1], inLink))] },
    { re: /~~(?=\S)([\s\S]*?\S)~~/, make: (m, inLink) => [el("del", ...renderInline(m[1], inLink))] },
    // `__x__` is deliberately not bold: model output about Python is full of __init__ outside backticks.
    { re: /\*(?=[^\s*])([\s\S]*?[^\s*])\*/, make: (m, inLink) => [el("em", ...renderInline(m[1], inLink))] },
    {
      re: /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/,
      make: (m, inLink) => [el("em", ...renderInline(m[1], inLink))],
    },
  ];

  // Text -> an array of nodes and strings (strings become text nodes when appended).
  function renderInline(text, inLink = false) {
    const out = [];
    let rest = text;
    while (rest) {
      let best = null;
      for (const rule of INLINE_RULES) {
        const m = rule.re.exec(rest);
        if (m && (best === null || m.index < best.m.index)) best = { rule, m };
      }
      if (best === null) {
        out.push(rest);
        break;
      }
      if (best.m.index) out.push(rest.slice(0, best.m.index));
      out.push(...best.rule.make(best.m, inLink));
      rest = rest.slice(best.m.index + best.m[0].length);
    }
    return out;
  }

  // Markdown text -> a DocumentFragment of safe nodes.
  function render(text) {
    const fragment = document.createDocumentFragment();
    renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment);
    return fragment;
  }

  return { render, renderInline, safeHref };
})();

window.FerryMarkdown = FerryMarkdown;
