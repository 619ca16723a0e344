//! Compact renderings of page lists, for `Display` impls and snapshots.

/// Renders a list of page ids compactly: ascending runs of consecutive ids as `a-b`.
pub fn render_page_runs(pages: impl IntoIterator<Item = u32>) -> String {
    let mut out = String::new();
    let mut run: Option<(u32, u32)> = None;
    let flush = |out: &mut String, (a, b): (u32, u32)| {
        if !out.is_empty() {
            out.push(' ');
        }
        if a == b {
            out.push_str(&a.to_string());
        } else {
            out.push_str(&format!("{a}-{b}"));
        }
    };
    for p in pages {
        run = match run {
            Some((a, b)) if p == b + 1 => Some((a, p)),
            Some(r) => {
                flush(&mut out, r);
                Some((p, p))
            }
            None => Some((p, p)),
        };
    }
    if let Some(r) = run {
        flush(&mut out, r);
    }
    out
}
