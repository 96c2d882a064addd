//! Outbound HTTP of the built-in tools (`http_get`, `triage`'s callback).
//!
//! - Where they may go: [`Origins`], the operator's `AGENTQ_AGENT_HTTP_ALLOW`, names origins
//!   (scheme, host and port). A bare host allows its default ports only, so allowing a host
//!   never opens its other ports; a URL with `user:pass@` is refused.
//! - What they read: answers are capped while they stream ([`read_capped`]), so a huge or
//!   endless answer costs at most the cap in memory: the connection is dropped past it.

pub use agentq_core::origins::Origins;

/// The body of `response`, at most `cap` bytes, and whether there was more (then the rest was
/// never read and the connection is dropped).
pub async fn read_capped(
    mut response: reqwest::Response,
    cap: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = cap - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server announcing 300 MB and streaming zeros until the client goes away; returns its
    /// URL and the bytes it managed to write.
    async fn endless() -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let written = Arc::new(AtomicUsize::new(0));
        let w = written.clone();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 1024];
            let _ = socket.read(&mut request).await;
            let head = "HTTP/1.1 200 OK\r\ncontent-length: 300000000\r\n\r\n";
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let block = vec![0u8; 64 * 1024];
            while w.load(Ordering::SeqCst) < 300_000_000 {
                match socket.write_all(&block).await {
                    Ok(()) => w.fetch_add(block.len(), Ordering::SeqCst),
                    Err(_) => return,
                };
            }
        });
        (url, written)
    }

    #[tokio::test]
    async fn a_huge_answer_is_cut_at_the_cap_without_being_read() {
        let (url, written) = endless().await;
        let response = reqwest::get(&url).await.unwrap();
        let (body, truncated) = read_capped(response, 64 * 1024).await.unwrap();
        assert_eq!((body.len(), truncated), (64 * 1024, true));
        // The server stops once the client has dropped the connection: what it wrote is
        // bounded by socket buffers, far below the 300 MB announced.
        let mut last = usize::MAX;
        for _ in 0..100 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let now = written.load(Ordering::SeqCst);
            if now == last {
                break;
            }
            last = now;
        }
        assert!(last < 32 * 1024 * 1024, "the server wrote {last} bytes");
    }

    #[tokio::test]
    async fn a_small_answer_is_read_whole() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 1024];
            let _ = socket.read(&mut request).await;
            let _ = socket
                .write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
                )
                .await;
        });
        let response = reqwest::get(&url).await.unwrap();
        assert_eq!(
            read_capped(response, 5).await.unwrap(),
            (b"hello".to_vec(), false)
        );
    }
}
