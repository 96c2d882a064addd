//! The origins agentq's built-in tools may call (`AGENTQ_AGENT_HTTP_ALLOW`): scheme, host and
//! port, so allowing a host never opens its other ports, and never a URL with credentials.
//! Parsed once when a process starts (`Config::validate`), checked by every outbound call.

/// The origins outbound calls may reach (`AGENTQ_AGENT_HTTP_ALLOW`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Origins(Vec<(String, String, u16)>);

impl Origins {
    /// Parses the list: `https://host[:port]`, `http://host[:port]` (the scheme's default port
    /// when none is given), or a bare `host` (https on 443 and http on 80). An entry with a
    /// path, a query or credentials is refused, naming it.
    pub fn parse(entries: &[String]) -> Result<Self, String> {
        let mut out = Vec::new();
        for e in entries {
            let bad = |why: &str| {
                format!(
                    "AGENTQ_AGENT_HTTP_ALLOW entry {e:?} {why}: give origins such as \
                     https://api.example.com or http://127.0.0.1:8080, or a bare host name"
                )
            };
            if e.contains("://") {
                let url = url::Url::parse(e).map_err(|_| bad("is not a URL"))?;
                if !matches!(url.scheme(), "http" | "https") {
                    return Err(bad("is not http or https"));
                }
                if !url.username().is_empty() || url.password().is_some() {
                    return Err(bad("carries credentials"));
                }
                if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
                    return Err(bad("has a path or query (an origin has neither)"));
                }
                let host = url.host_str().ok_or_else(|| bad("has no host"))?;
                let port = url
                    .port_or_known_default()
                    .ok_or_else(|| bad("has no port"))?;
                out.push((url.scheme().to_string(), host.to_ascii_lowercase(), port));
            } else {
                if e.is_empty() || e.contains(['/', '@', '?', '#', ':', ' ']) {
                    return Err(bad("is not a host name"));
                }
                let host = e.to_ascii_lowercase();
                out.push(("https".into(), host.clone(), 443));
                out.push(("http".into(), host, 80));
            }
        }
        Ok(Self(out))
    }

    /// `url` if its origin is allowed; else why not, saying what to allow.
    pub fn check(&self, url: &url::Url) -> Result<(), String> {
        if !url.username().is_empty() || url.password().is_some() {
            return Err("the URL carries credentials (user:pass@); they are never sent".into());
        }
        let scheme = url.scheme();
        let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
        let port = url.port_or_known_default().unwrap_or(0);
        if matches!(scheme, "http" | "https")
            && self
                .0
                .iter()
                .any(|(s, h, p)| s == scheme && *h == host && *p == port)
        {
            return Ok(());
        }
        Err(format!(
            "{scheme}://{host}:{port} is not an allowed origin: add it to AGENTQ_AGENT_HTTP_ALLOW \
             on the workers"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_allow_exact_scheme_host_and_port_only() {
        let list =
            |v: &[&str]| Origins::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let o = list(&[
            "api.example.com",
            "http://127.0.0.1:8080",
            "https://Hooks.Example.com:8443",
        ])
        .unwrap();
        let check = |u: &str| o.check(&url::Url::parse(u).unwrap());
        for ok in [
            "https://api.example.com/v1?x=1",
            "http://api.example.com/",
            "http://127.0.0.1:8080/cb",
            "https://hooks.example.com:8443/",
        ] {
            assert!(check(ok).is_ok(), "{ok}");
        }
        for refused in [
            "https://api.example.com:8443/",
            "http://127.0.0.1:5432/",
            "http://127.0.0.1/",
            "https://127.0.0.1:8080/",
            "http://user:pass@127.0.0.1:8080/",
            "https://evil.example.com/",
            "ftp://api.example.com/",
        ] {
            assert!(check(refused).is_err(), "{refused}");
        }
        assert!(
            check("http://user:pass@127.0.0.1:8080/")
                .unwrap_err()
                .contains("credentials")
        );
        for bad in [
            "http://u:p@h:1",
            "https://h/path",
            "h:8080",
            "ftp://h",
            "a b",
        ] {
            assert!(list(&[bad]).is_err(), "{bad}");
        }
    }
}
