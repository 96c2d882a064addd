//! Outbound HTTP of the built-in tools (`http_get`, `triage`'s callback) and of registered
//! services (their manifest, and every call of the step protocol).
//!
//! - Where they may go: [`Origins`], the operator's `AGENTQ_AGENT_HTTP_ALLOW`, names origins
//!   (scheme, host and port). A bare host allows its default ports only, so allowing a host
//!   never opens its other ports; a URL with `user:pass@` is refused.
//! - Which address they reach: [`Client`] resolves a host name once per connection and hands
//!   the connector exactly the addresses it checked, so a name cannot pass the check with one
//!   answer and be connected with another (DNS rebinding). A name's unspecified, link-local
//!   (169.254.169.254, cloud metadata), multicast and broadcast addresses are never used;
//!   loopback and private ones are, as operators name internal services. An IP literal in a
//!   URL is not resolved: for the tools the allow-list alone governs it; for a service
//!   ([`Reach::service`]), which no allow-list covers, it is checked as a name's addresses
//!   are. Link-local and cloud metadata addresses are reachable only where an admin said so
//!   (a service registered with `--allow-link-local`). The answer's peer address is
//!   compared with what was approved once more, and no proxy is ever used (a proxy would
//!   resolve the name itself).
//! - What they read: answers are capped while they stream ([`read_capped`]), so a huge or
//!   endless answer costs at most the cap in memory: the connection is dropped past it.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

pub use crate::origins::Origins;

/// How a host name becomes addresses: the system resolver in production ([`SystemLookup`]),
/// a fake in tests (a name that answers differently each time, counting its calls).
#[async_trait]
pub trait Lookup: Send + Sync {
    /// Every address `host` resolves to now.
    async fn lookup(&self, host: &str) -> std::io::Result<Vec<IpAddr>>;
}

/// The operating system's resolver (`getaddrinfo`, through tokio).
pub struct SystemLookup;

#[async_trait]
impl Lookup for SystemLookup {
    async fn lookup(&self, host: &str) -> std::io::Result<Vec<IpAddr>> {
        Ok(tokio::net::lookup_host((host, 0))
            .await?
            .map(|a| a.ip())
            .collect())
    }
}

/// Why an outbound call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Refused before any connection was made: every address the host name resolves to is one
    /// agentq never calls through a name. Nothing was sent.
    #[error("{0}")]
    Refused(String),
    /// The answer came from an address the resolver did not approve. The request was sent.
    #[error("{0}")]
    UnapprovedPeer(String),
    /// The exchange itself failed (connect, TLS, timeout, protocol). Carries no URL, so no
    /// query string ever reaches a message.
    #[error(transparent)]
    Http(reqwest::Error),
}

/// The addresses the resolver handed the connector, per host name (lower case).
type Approved = Arc<Mutex<HashMap<String, HashSet<IpAddr>>>>;

/// Which addresses a client may reach beyond what a name may lead to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reach {
    /// A URL's IP literal is checked as a name's addresses are (no allow-list covers it).
    pub literals: bool,
    /// Link-local and cloud metadata addresses may be reached (an admin said so).
    pub link_local: bool,
}

impl Reach {
    /// A registered service's: literals checked; link-local and metadata addresses only when
    /// its registration allowed them.
    pub fn service(allow_link_local: bool) -> Self {
        Self {
            literals: true,
            link_local: allow_link_local,
        }
    }
}

/// The HTTP client of the built-in tools: no redirects, no proxy, and a resolver that checks
/// the addresses it hands the connector. Build one per call with [`Client::new`], send with
/// [`Client::send`].
pub struct Client {
    http: reqwest::Client,
    approved: Approved,
    reach: Reach,
}

impl Client {
    /// A client whose whole exchange ends after `timeout`, and whose connecting ends after
    /// `connect_timeout` when one is given; names resolved by the system.
    pub fn new(timeout: Duration, connect_timeout: Option<Duration>) -> Result<Self, Error> {
        Self::with_lookup(timeout, connect_timeout, Arc::new(SystemLookup))
    }

    /// [`Client::new`] reaching what `reach` allows.
    pub fn reaching(
        timeout: Duration,
        connect_timeout: Option<Duration>,
        reach: Reach,
    ) -> Result<Self, Error> {
        Self::build(timeout, connect_timeout, Arc::new(SystemLookup), reach)
    }

    /// [`Client::new`] with names resolved by `lookup`.
    pub fn with_lookup(
        timeout: Duration,
        connect_timeout: Option<Duration>,
        lookup: Arc<dyn Lookup>,
    ) -> Result<Self, Error> {
        Self::build(timeout, connect_timeout, lookup, Reach::default())
    }

    fn build(
        timeout: Duration,
        connect_timeout: Option<Duration>,
        lookup: Arc<dyn Lookup>,
        reach: Reach,
    ) -> Result<Self, Error> {
        let approved = Approved::default();
        let resolver = CheckedResolver {
            lookup,
            approved: approved.clone(),
            reach,
        };
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(resolver));
        if let Some(connect) = connect_timeout {
            builder = builder.connect_timeout(connect);
        }
        let http = builder.build().map_err(|e| Error::Http(e.without_url()))?;
        Ok(Self {
            http,
            approved,
            reach,
        })
    }

    /// A GET of `url`, to hand to [`Client::send`].
    pub fn get(&self, url: Url) -> reqwest::RequestBuilder {
        self.http.get(url)
    }

    /// A POST to `url`, to hand to [`Client::send`].
    pub fn post(&self, url: Url) -> reqwest::RequestBuilder {
        self.http.post(url)
    }

    /// Sends `request` and returns the answer once its peer address is checked against the
    /// addresses the resolver approved for the URL's host (or the URL's own IP literal).
    pub async fn send(&self, request: reqwest::RequestBuilder) -> Result<reqwest::Response, Error> {
        let request = request.build().map_err(|e| Error::Http(e.without_url()))?;
        let url = request.url().clone();
        if self.reach.literals
            && let Some(ip) = literal(&url)
            && let Some(what) = refused(ip, self.reach)
        {
            return Err(Error::Refused(format!(
                "{ip} is {what}; agentq calls it only for a service registered with \
                 --allow-link-local"
            )));
        }
        let response = self
            .http
            .execute(request)
            .await
            .map_err(|e| match refusal(&e) {
                Some(why) => Error::Refused(why),
                None => Error::Http(e.without_url()),
            })?;
        let approved = self.approved.lock().unwrap_or_else(|p| p.into_inner());
        check_peer(&url, response.remote_addr(), &approved)?;
        drop(approved);
        Ok(response)
    }
}

/// The refusal of [`CheckedResolver`] inside `e`'s chain of causes, if that is why it failed.
fn refusal(e: &reqwest::Error) -> Option<String> {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(Refusal(why)) = cause.downcast_ref::<Refusal>() {
            return Some(why.clone());
        }
        source = cause.source();
    }
    None
}

/// Why [`CheckedResolver`] gave the connector no address for a name.
#[derive(Debug)]
struct Refusal(String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refusal {}

/// Resolves each name once per connection, drops the addresses never called through a name,
/// records the rest as approved and hands exactly those to the connector.
struct CheckedResolver {
    lookup: Arc<dyn Lookup>,
    approved: Approved,
    reach: Reach,
}

impl Resolve for CheckedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_ascii_lowercase();
        let lookup = self.lookup.clone();
        let approved = self.approved.clone();
        let reach = self.reach;
        Box::pin(async move {
            let answers = lookup.lookup(&host).await?;
            let usable = usable_addresses(&host, &answers, reach).map_err(Refusal)?;
            approved
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(host)
                .or_default()
                .extend(usable.iter().copied());
            // Port 0: the connector puts the URL's port (or the scheme's default) in.
            let addrs: Addrs = Box::new(usable.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}

/// The addresses of `answers` a name may lead to, in their order; if there is none, why not,
/// naming the host and saying what to configure.
fn usable_addresses(host: &str, answers: &[IpAddr], reach: Reach) -> Result<Vec<IpAddr>, String> {
    if answers.is_empty() {
        return Err(format!("{host} resolves to no address"));
    }
    let usable: Vec<IpAddr> = answers
        .iter()
        .copied()
        .filter(|ip| refused(*ip, reach).is_none())
        .collect();
    if !usable.is_empty() {
        return Ok(usable);
    }
    let mut listed: Vec<String> = answers
        .iter()
        .take(4)
        .map(|ip| format!("{ip}, {}", refused(*ip, reach).unwrap_or_default()))
        .collect();
    if answers.len() > 4 {
        listed.push("…".into());
    }
    let what_to_do = if reach.literals {
        "a service at a link-local or metadata address is registered with --allow-link-local"
    } else {
        "call the address itself and list it in AGENTQ_AGENT_HTTP_ALLOW if you mean it"
    };
    Err(format!(
        "{host} resolves to {}; agentq never calls such an address through a name: {what_to_do}",
        listed.join("; ")
    ))
}

/// A URL's host as an IP address, if it is one (IPv6 in brackets).
fn literal(url: &Url) -> Option<IpAddr> {
    let host = url.host_str()?;
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .parse()
        .ok()
}

/// Cloud metadata services at addresses that are not link-local: AWS's IPv6 one (fd00:ec2::254)
/// and Alibaba's (100.100.100.200). (The common one, 169.254.169.254, is link-local.)
fn metadata(ip: IpAddr) -> bool {
    let v4 = match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(v6) => v6.to_ipv4_mapped(),
    };
    v4 == Some(Ipv4Addr::new(100, 100, 100, 200))
        || ip == IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254))
}

/// What kind of address `ip` is if `reach` may not lead to it: [`never_through_a_name`]'s,
/// and a cloud metadata address; link-local and metadata ones are allowed where
/// `reach.link_local` says so.
fn refused(ip: IpAddr, reach: Reach) -> Option<&'static str> {
    let what =
        never_through_a_name(ip).or_else(|| metadata(ip).then_some("a cloud metadata address"));
    match what {
        Some("a link-local address" | "a cloud metadata address") if reach.link_local => None,
        other => other,
    }
}

/// What kind of address `ip` is if a host name may never lead to it: unspecified
/// (0.0.0.0/8, ::), link-local (169.254.0.0/16 with the cloud metadata address, fe80::/10),
/// multicast or broadcast, also written as an IPv4-mapped IPv6 address (::ffff:a.b.c.d).
fn never_through_a_name(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => never_through_a_name_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => never_through_a_name_v4(v4),
            None if v6.is_unspecified() => Some("an unspecified address"),
            None if v6.is_unicast_link_local() => Some("a link-local address"),
            None if v6.is_multicast() => Some("a multicast address"),
            None => None,
        },
    }
}

fn never_through_a_name_v4(v4: Ipv4Addr) -> Option<&'static str> {
    if v4.octets()[0] == 0 {
        Some("an unspecified address")
    } else if v4.is_link_local() {
        Some("a link-local address")
    } else if v4.is_multicast() {
        Some("a multicast address")
    } else if v4.is_broadcast() {
        Some("a broadcast address")
    } else {
        None
    }
}

/// Whether `peer`, the address an answer came from, is one the URL may lead to: the URL's IP
/// literal, or an address the resolver approved for its host name, on the URL's port.
fn check_peer(
    url: &Url,
    peer: Option<SocketAddr>,
    approved: &HashMap<String, HashSet<IpAddr>>,
) -> Result<(), Error> {
    let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
    let Some(peer) = peer else {
        return Err(Error::UnapprovedPeer(format!(
            "the answer from {host} does not say which address it came from"
        )));
    };
    // An IP literal (IPv6 in brackets) is connected to as written; a name, to what it
    // resolved to.
    let literal = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(&host)
        .parse::<IpAddr>();
    let ip_ok = match literal {
        Ok(ip) => peer.ip() == ip,
        Err(_) => approved
            .get(&host)
            .is_some_and(|ips| ips.contains(&peer.ip())),
    };
    if ip_ok && Some(peer.port()) == url.port_or_known_default() {
        return Ok(());
    }
    Err(Error::UnapprovedPeer(format!(
        "the answer for {host} came from {peer}, not an address checked for it; the answer \
         was discarded"
    )))
}

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

    /// A lookup that answers the n-th lookup of a name with its n-th answer (the last one
    /// from then on), and counts the lookups of each name.
    struct Scripted {
        answers: HashMap<&'static str, Vec<Vec<IpAddr>>>,
        lookups: Mutex<HashMap<String, usize>>,
    }

    impl Scripted {
        fn new(answers: &[(&'static str, &[&[&str]])]) -> Arc<Self> {
            let parse = |ips: &[&str]| ips.iter().map(|ip| ip.parse().unwrap()).collect();
            Arc::new(Self {
                answers: answers
                    .iter()
                    .map(|(name, seq)| (*name, seq.iter().map(|ips| parse(ips)).collect()))
                    .collect(),
                lookups: Mutex::default(),
            })
        }

        fn lookups(&self, host: &str) -> usize {
            self.lookups.lock().unwrap().get(host).copied().unwrap_or(0)
        }
    }

    #[async_trait]
    impl Lookup for Scripted {
        async fn lookup(&self, host: &str) -> std::io::Result<Vec<IpAddr>> {
            let n = {
                let mut lookups = self.lookups.lock().unwrap();
                let n = lookups.entry(host.to_string()).or_default();
                *n += 1;
                *n
            };
            let seq = self
                .answers
                .get(host)
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no such name"))?;
            Ok(seq[(n - 1).min(seq.len() - 1)].clone())
        }
    }

    /// A server on 127.0.0.1 answering `ok` and closing each connection (so every request
    /// needs a new connection, and a new lookup); returns its address and the connections it
    /// accepted.
    async fn closing_server() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let a = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut request = [0u8; 1024];
                    let _ = socket.read(&mut request).await;
                    let _ = socket
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                        )
                        .await;
                });
            }
        });
        (addr, accepted)
    }

    fn client(lookup: Arc<Scripted>) -> Client {
        Client::with_lookup(
            Duration::from_secs(10),
            Some(Duration::from_secs(5)),
            lookup,
        )
        .unwrap()
    }

    fn url(host: &str, port: u16) -> Url {
        Url::parse(&format!("http://{host}:{port}/")).unwrap()
    }

    #[test]
    fn a_name_never_leads_to_unspecified_link_local_multicast_or_broadcast_addresses() {
        for refused in [
            "0.0.0.0",
            "0.1.2.3",
            "::",
            "169.254.169.254",
            "169.254.0.1",
            "fe80::1",
            "febf::1",
            "224.0.0.1",
            "239.255.255.250",
            "ff02::1",
            "255.255.255.255",
            "::ffff:169.254.169.254",
            "::ffff:0.0.0.0",
            "::ffff:224.0.0.1",
            "::ffff:255.255.255.255",
        ] {
            let ip: IpAddr = refused.parse().unwrap();
            assert!(never_through_a_name(ip).is_some(), "{refused}");
        }
        for allowed in [
            "127.0.0.1",
            "::1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "fc00::1",
            "fd12::1",
            "93.184.216.34",
            "2606:4700::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "fec0::1",
        ] {
            let ip: IpAddr = allowed.parse().unwrap();
            assert!(never_through_a_name(ip).is_none(), "{allowed}");
        }
        let why = usable_addresses(
            "api.example",
            &["169.254.169.254".parse().unwrap()],
            Reach::default(),
        )
        .unwrap_err();
        assert!(why.contains("api.example"), "{why}");
        assert!(
            why.contains("169.254.169.254, a link-local address"),
            "{why}"
        );
        assert!(why.contains("AGENTQ_AGENT_HTTP_ALLOW"), "{why}");
    }

    /// DNS rebinding: the name answers a usable address the first time (the test server;
    /// loopback stands in for a public address) and the metadata address the second time.
    /// Each connection resolves the name exactly once and connects to what that lookup
    /// approved; the second connection is refused before any connection is attempted.
    #[tokio::test]
    async fn a_name_is_resolved_once_per_connection_and_connected_to_as_checked() {
        let (server, accepted) = closing_server().await;
        let lookup = Scripted::new(&[("rebind.test", &[&["127.0.0.1"], &["169.254.169.254"]])]);
        let client = client(lookup.clone());

        let response = client
            .send(client.get(url("rebind.test", server.port())))
            .await
            .unwrap();
        assert_eq!(response.remote_addr(), Some(server));
        assert_eq!(response.text().await.unwrap(), "ok");
        assert_eq!(lookup.lookups("rebind.test"), 1);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);

        let refused = client
            .send(client.get(url("rebind.test", server.port())))
            .await
            .unwrap_err();
        assert_eq!(lookup.lookups("rebind.test"), 2);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        let Error::Refused(why) = refused else {
            panic!("{refused:?}")
        };
        assert!(
            why.starts_with("rebind.test resolves to 169.254.169.254, a link-local address"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn a_name_of_the_metadata_address_is_refused_without_connecting() {
        let lookup = Scripted::new(&[("metadata.test", &[&["169.254.169.254"]])]);
        let client = client(lookup.clone());
        let refused = client
            .send(client.post(url("metadata.test", 80)).body("secret"))
            .await
            .unwrap_err();
        assert_eq!(lookup.lookups("metadata.test"), 1);
        let Error::Refused(why) = &refused else {
            panic!("{refused:?}")
        };
        assert!(
            why.contains("metadata.test resolves to 169.254.169.254"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn only_the_usable_addresses_of_a_name_reach_the_connector() {
        let (server, accepted) = closing_server().await;
        let lookup = Scripted::new(&[(
            "mixed.test",
            &[&[
                "169.254.169.254",
                "0.0.0.0",
                "::ffff:169.254.169.254",
                "127.0.0.1",
            ]],
        )]);
        let client = client(lookup.clone());
        let response = client
            .send(client.get(url("mixed.test", server.port())))
            .await
            .unwrap();
        assert_eq!(response.remote_addr(), Some(server));
        assert_eq!(
            (
                lookup.lookups("mixed.test"),
                accepted.load(Ordering::SeqCst)
            ),
            (1, 1)
        );
    }

    #[tokio::test]
    async fn an_ip_literal_is_connected_to_without_a_lookup() {
        let (server, _) = closing_server().await;
        let lookup = Scripted::new(&[]);
        let client = client(lookup.clone());
        let response = client
            .send(client.get(url("127.0.0.1", server.port())))
            .await
            .unwrap();
        assert_eq!(response.remote_addr(), Some(server));
        assert!(lookup.lookups.lock().unwrap().is_empty());
    }

    #[test]
    fn an_answer_from_an_address_the_name_did_not_resolve_to_is_refused() {
        let approved: HashMap<String, HashSet<IpAddr>> = [(
            "svc.test".to_string(),
            ["127.0.0.1".parse().unwrap()].into(),
        )]
        .into();
        let check = |u: &str, peer: Option<&str>| {
            check_peer(
                &Url::parse(u).unwrap(),
                peer.map(|p| p.parse().unwrap()),
                &approved,
            )
        };
        assert!(check("http://svc.test:8080/", Some("127.0.0.1:8080")).is_ok());
        assert!(check("http://SVC.test:8080/x?q=1", Some("127.0.0.1:8080")).is_ok());
        assert!(check("http://127.0.0.2:8080/", Some("127.0.0.2:8080")).is_ok());
        assert!(check("http://[::1]:8080/", Some("[::1]:8080")).is_ok());
        for (u, peer) in [
            ("http://svc.test:8080/", Some("127.0.0.2:8080")),
            ("http://svc.test:8080/", Some("127.0.0.1:9090")),
            ("http://svc.test:8080/", None),
            ("http://other.test:8080/", Some("127.0.0.1:8080")),
            ("http://127.0.0.2:8080/", Some("127.0.0.1:8080")),
            ("http://[::1]:8080/", Some("127.0.0.1:8080")),
        ] {
            let refused = check(u, peer).unwrap_err();
            assert!(matches!(refused, Error::UnapprovedPeer(_)), "{u} {peer:?}");
            assert!(!refused.to_string().contains("?q"), "{refused}");
        }
    }

    #[test]
    fn a_service_reaches_no_link_local_or_metadata_address_unless_allowed() {
        let service = Reach::service(false);
        for refused_ip in [
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "fe80::1",
            "100.100.100.200",
            "fd00:ec2::254",
            "0.0.0.0",
        ] {
            let ip: IpAddr = refused_ip.parse().unwrap();
            assert!(refused(ip, service).is_some(), "{refused_ip}");
        }
        for fine in [
            "127.0.0.1",
            "10.1.2.3",
            "192.168.1.1",
            "::1",
            "93.184.216.34",
        ] {
            assert!(refused(fine.parse().unwrap(), service).is_none(), "{fine}");
        }
        let allowed = Reach::service(true);
        for ip in [
            "169.254.169.254",
            "100.100.100.200",
            "fd00:ec2::254",
            "fe80::1",
        ] {
            assert!(refused(ip.parse().unwrap(), allowed).is_none(), "{ip}");
        }
        assert!(refused("0.0.0.0".parse().unwrap(), allowed).is_some());
        assert_eq!(
            literal(&"http://[fd00:ec2::254]:80/x".parse().unwrap()),
            Some("fd00:ec2::254".parse().unwrap())
        );
        assert_eq!(literal(&"http://api.example/".parse().unwrap()), None);
    }

    #[tokio::test]
    async fn a_services_literal_address_is_refused_before_anything_is_sent() {
        let client = Client::reaching(Duration::from_secs(5), None, Reach::service(false)).unwrap();
        let sent = client
            .send(client.get("http://169.254.169.254/latest/meta-data/".parse().unwrap()))
            .await;
        let Err(Error::Refused(why)) = sent else {
            panic!("not refused: {sent:?}");
        };
        assert!(
            why.contains("link-local") && why.contains("--allow-link-local"),
            "{why}"
        );
    }
}
