// A small Markdown renderer for model answers: fenced code (also unfinished ones while a reply
// streams), inline code, headings, lists, quotes, rules, bold, italics and http(s) links.
// Everything is HTML-escaped first; only the tags made here reach the page.
"use strict";

const PagedMarkdown = (() => {
  function escape(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  function emphasis(html) {
    return html
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\s][^*\n]*?)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)"]+)\)/g,
        '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
  }

  function inline(text) {
    return text.split(/(`[^`\n]+`)/).map((part) => {
      if (part.length > 2 && part[0] === "`" && part[part.length - 1] === "`") {
        return "<code>" + escape(part.slice(1, -1)) + "</code>";
      }
      return emphasis(escape(part));
    }).join("");
  }

  function codeBlock(lang, lines) {
    const label = lang ? escape(lang) : "code";
    const cls = lang ? ' class="lang-' + escape(lang) + '"' : "";
    return '<div class="codeblock"><div class="code-head"><span>' + label +
      '</span><button type="button" class="copy">copy</button></div><pre><code' + cls + ">" +
      escape(lines.join("\n")) + "</code></pre></div>";
  }

  const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;

  function render(source) {
    const lines = source.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    const flush = () => {
      // Line breaks and indentation are kept (the stylesheet pre-wraps paragraphs): models
      // often answer with plain lines or unfenced code.
      if (para.length) out.push("<p>" + para.map(inline).join("\n") + "</p>");
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/);
      if (fence) {
        flush();
        const body = [];
        let j = i + 1;
        while (j < lines.length && !lines[j].trim().startsWith(fence[1])) body.push(lines[j++]);
        out.push(codeBlock(fence[2], body));
        i = j;  // the closing fence (or the end of an unfinished block)
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flush();
        const level = heading[1].length;
        out.push("<h" + level + ">" + inline(heading[2]) + "</h" + level + ">");
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        out.push("<hr>");
        continue;
      }
      if (/^\s*>/.test(line)) {
        flush();
        const quoted = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) {
          quoted.push(lines[i].replace(/^\s*>\s?/, ""));
          i++;
        }
        i--;
        out.push("<blockquote>" + render(quoted.join("\n")) + "</blockquote>");
        continue;
      }
      const item = line.match(LIST_ITEM);
      if (item) {
        flush();
        const ordered = /\d/.test(item[1]);
        const items = [];
        while (i < lines.length && LIST_ITEM.test(lines[i])) {
          items.push("<li>" + inline(lines[i].match(LIST_ITEM)[2]) + "</li>");
          i++;
        }
        i--;
        const tag = ordered ? "ol" : "ul";
        out.push("<" + tag + ">" + items.join("") + "</" + tag + ">");
        continue;
      }
      if (!line.trim()) {
        flush();
        continue;
      }
      para.push(line);
    }
    flush();
    return out.join("\n");
  }

  return { render, escape };
})();
