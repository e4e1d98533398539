//! List pages bounded twice: by a count (the request's `limit` under the server's `max_list`)
//! and by the encoded bytes of their items (`max_list_bytes`), so that no list reply can grow
//! past the reply limit however large the records are. Pure: no state, no I/O.

use prost::Message;

/// Bytes `item` adds to a reply as one element of a repeated message field whose number is
/// below 16 (a one-byte key, the length, the body): every list response's items are field 1.
pub fn item_bytes<T: Message>(item: &T) -> usize {
    let n = item.encoded_len();
    1 + prost::length_delimiter_len(n) + n
}

/// The count of a page: the request's `limit`, where 0 or more than `max_list` means `max_list`.
pub fn count(limit: u32, max_list: u32) -> usize {
    (if limit == 0 { max_list } else { limit.min(max_list) }) as usize
}

/// One page being filled, in the list's order.
#[derive(Debug)]
pub struct Page<T> {
    items: Vec<T>,
    bytes: usize,
    limit: usize,
    max_bytes: usize,
    more: bool,
}

impl<T: Message> Page<T> {
    /// An empty page of at most `limit` items (at least one) and `max_bytes` bytes of items.
    pub fn new(limit: usize, max_bytes: usize) -> Self {
        Self { items: Vec::new(), bytes: 0, limit: limit.max(1), max_bytes, more: false }
    }

    /// Offers the next item of the list (`make` builds it, and runs only while the page has
    /// room for another item). Answers false, and marks that more items follow, when the page
    /// is full: in count, or because this item would take it over its bytes. The first item
    /// is always taken, whatever its size: callers that must bound it cut it to
    /// [`Page::max_bytes`] first.
    pub fn offer(&mut self, make: impl FnOnce() -> T) -> bool {
        if self.items.len() >= self.limit {
            self.more = true;
            return false;
        }
        let item = make();
        let b = item_bytes(&item);
        if !self.items.is_empty() && self.bytes.saturating_add(b) > self.max_bytes {
            self.more = true;
            return false;
        }
        self.bytes += b;
        self.items.push(item);
        true
    }

    /// The byte bound of the page's items.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The page's items, and the page token: `token(last item)` when more follow, else `None`.
    pub fn finish<K>(self, token: impl FnOnce(&T) -> K) -> (Vec<T>, Option<K>) {
        let next = if self.more { self.items.last().map(token) } else { None };
        debug_assert!(self.items.len() <= self.limit, "a page over its count");
        debug_assert!(self.items.len() <= 1 || self.bytes <= self.max_bytes, "a page over its bytes");
        (self.items, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use suanli_proto::v1 as pb;

    fn queue(id: &str, team_bytes: usize) -> pb::QueueInfo {
        pb::QueueInfo { id: id.into(), team: "t".repeat(team_bytes), ..Default::default() }
    }

    /// Pages of `items` with the given bounds, each as (ids, token).
    fn pages(items: &[pb::QueueInfo], limit: usize, max_bytes: usize) -> Vec<(Vec<String>, Option<String>)> {
        let mut out = Vec::new();
        let mut at = 0;
        loop {
            let mut p = Page::new(limit, max_bytes);
            for q in &items[at..] {
                if !p.offer(|| q.clone()) {
                    break;
                }
            }
            let (page, next) = p.finish(|q| q.id.clone());
            at += page.len();
            let total: usize = page.iter().map(item_bytes).sum();
            assert!(page.len() <= limit.max(1));
            assert!(page.len() == 1 || total <= max_bytes, "{total} > {max_bytes}");
            out.push((page.into_iter().map(|q| q.id).collect(), next.clone()));
            if next.is_none() {
                assert_eq!(at, items.len(), "the last page left items out");
                return out;
            }
        }
    }

    #[test]
    fn pages_end_at_the_count_or_the_bytes_and_hold_at_least_one() {
        let items: Vec<_> = (0..10).map(|i| queue(&format!("q{i}"), 100)).collect();
        let one = item_bytes(&items[0]);
        // By count.
        let p = pages(&items, 4, 1 << 20);
        assert_eq!(p.iter().map(|(v, _)| v.len()).collect::<Vec<_>>(), [4, 4, 2]);
        assert_eq!(p[0].1.as_deref(), Some("q3"));
        assert_eq!(p[2].1, None);
        // By bytes: three fit exactly, a fourth would not.
        let p = pages(&items, 100, 3 * one);
        assert_eq!(p.iter().map(|(v, _)| v.len()).collect::<Vec<_>>(), [3, 3, 3, 1]);
        // An item larger than the byte bound comes alone, and the list still ends.
        let mut items = items;
        items[1] = queue("q1", 10_000);
        let p = pages(&items, 100, 3 * one);
        assert_eq!(p[0].0, ["q0"]);
        assert_eq!(p[1].0, ["q1"]);
        // Exactly `limit` items left: no token, no empty last page.
        let p = pages(&items[..4], 4, 1 << 20);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].1, None);
    }

    #[test]
    fn count_caps_the_limit() {
        assert_eq!(count(0, 10), 10);
        assert_eq!(count(3, 10), 3);
        assert_eq!(count(30, 10), 10);
    }

    #[test]
    fn item_bytes_is_what_a_response_grows_by() {
        let q = queue("a", 300);
        let one = pb::ListQueuesResponse { queues: vec![q.clone()], next_after: String::new() };
        let two = pb::ListQueuesResponse { queues: vec![q.clone(), q.clone()], next_after: String::new() };
        assert_eq!(one.encoded_len(), item_bytes(&q));
        assert_eq!(two.encoded_len(), 2 * item_bytes(&q));
    }
}
