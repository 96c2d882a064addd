//! The `read` and `write` steps: the tenant's stores resolved when the step runs, a document
//! read from a store's directory or table (checked to be text of a bounded size), and the
//! migrated text written to the target atomically (a file renamed into place, or an upsert).
//! Nothing resolves outside a store's directory, symlinks included.

use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use agentq_core::db::batch_source;
use agentq_core::db::stores::{self, Access, Location, Store};
use sqlx::PgPool;
use uuid::Uuid;

use agentq_worker::JobError;

use crate::tables::docs;

use super::{
    DocMigrationInput, Document, MAX_DOCUMENT_BYTES, Written, describe_source, sha256_hex,
};

/// The tenant's store `name`, resolved when the step runs (never from the input), with the
/// access the step needs. A store removed or narrowed since the enqueue fails the document.
async fn resolve(
    pool: &PgPool,
    tenant: &str,
    name: &str,
    access: Access,
) -> Result<Store, JobError> {
    let store = stores::get(pool, tenant, name)
        .await
        .map_err(|e| JobError::retryable(format!("database: {e}")))?
        .ok_or_else(|| {
            JobError::NonRetryable(format!(
                "store {name:?} is not registered for tenant {tenant} (removed after the \
                 enqueue?); an admin registers it with `agentq stores add`"
            ))
        })?;
    if !store.access.grants(access) {
        return Err(JobError::NonRetryable(format!(
            "store {name:?} is registered for {} only; this step needs {}",
            store.access.as_str(),
            access.as_str()
        )));
    }
    Ok(store)
}

pub(super) async fn read_document(
    pool: &PgPool,
    tenant: &str,
    input: &DocMigrationInput,
) -> Result<Document, JobError> {
    let store = resolve(pool, tenant, &input.source, Access::Read).await?;
    let text = match &store.location {
        Location::Dir(dir) => {
            let (dir, doc_id) = (dir.clone(), input.doc_id.clone());
            tokio::task::spawn_blocking(move || read_file(&dir, &doc_id))
                .await
                .map_err(|e| JobError::retryable(format!("reading the document: {e}")))??
        }
        Location::Table {
            table,
            id_column,
            body_column,
        } => {
            let rows = docs::read_source(pool, table, id_column, body_column, &input.doc_id)
                .await
                .map_err(db_failure)?;
            match rows.as_slice() {
                [] => {
                    return Err(JobError::NonRetryable(format!(
                        "document not found: no row of {} has {} = doc_id",
                        table.as_str(),
                        id_column.as_str()
                    )));
                }
                [body] => body.clone().unwrap_or_default(),
                _ => {
                    return Err(JobError::NonRetryable(format!(
                        "doc_id is not unique: several rows of {} have that {}",
                        table.as_str(),
                        id_column.as_str()
                    )));
                }
            }
        }
    };
    check_text(&text)?;
    Ok(Document {
        doc_id: input.doc_id.clone(),
        source: describe_source(&input.source),
        sha256: sha256_hex(text.as_bytes()),
        bytes: text.len(),
        text,
    })
}

fn check_text(text: &str) -> Result<(), JobError> {
    if text.trim().is_empty() {
        return Err(JobError::NonRetryable("document is empty".into()));
    }
    if text.len() > MAX_DOCUMENT_BYTES {
        return Err(too_large());
    }
    if text.contains('\0') {
        return Err(JobError::NonRetryable(
            "document contains NUL characters (not text)".into(),
        ));
    }
    Ok(())
}

fn too_large() -> JobError {
    JobError::NonRetryable(format!(
        "document is larger than {} MiB",
        MAX_DOCUMENT_BYTES / (1024 * 1024)
    ))
}

/// Reads `root/doc_id`, refusing anything that resolves outside `root` (a symlink included).
fn read_file(root: &Path, doc_id: &str) -> Result<String, JobError> {
    let root = root.canonicalize().map_err(|e| match e.kind() {
        ErrorKind::NotFound => JobError::NonRetryable(format!(
            "the source store's directory {} does not exist",
            root.display()
        )),
        _ => io_failure("opening the source store's directory", e),
    })?;
    let path = root
        .join(doc_id)
        .canonicalize()
        .map_err(|e| match e.kind() {
            ErrorKind::NotFound => {
                JobError::NonRetryable("document not found in the source store".into())
            }
            _ => io_failure("opening the document", e),
        })?;
    if !path.starts_with(&root) {
        return Err(JobError::NonRetryable(
            "document path resolves outside the source store's directory".into(),
        ));
    }
    let meta = std::fs::metadata(&path).map_err(|e| io_failure("opening the document", e))?;
    if !meta.is_file() {
        return Err(JobError::NonRetryable(
            "document is not a regular file".into(),
        ));
    }
    if meta.len() > MAX_DOCUMENT_BYTES as u64 {
        return Err(too_large());
    }
    let bytes = std::fs::read(&path).map_err(|e| io_failure("reading the document", e))?;
    String::from_utf8(bytes)
        .map_err(|_| JobError::NonRetryable("document is not UTF-8 text".into()))
}

/// A file-system error: permanent ones (permissions, a directory where a file should be, a
/// read-only file system, a name too long) are non-retryable, anything else retryable.
fn io_failure(doing: &str, e: std::io::Error) -> JobError {
    let permanent = matches!(
        e.kind(),
        ErrorKind::PermissionDenied
            | ErrorKind::IsADirectory
            | ErrorKind::NotADirectory
            | ErrorKind::DirectoryNotEmpty
            | ErrorKind::ReadOnlyFilesystem
            | ErrorKind::InvalidFilename
            | ErrorKind::InvalidInput
    );
    let message = format!("{doing}: {}", e.kind());
    if permanent {
        JobError::NonRetryable(message)
    } else {
        JobError::retryable(message)
    }
}

fn db_failure(e: batch_source::Error) -> JobError {
    match e {
        batch_source::Error::Schema(m) => JobError::NonRetryable(m),
        batch_source::Error::Db(e) => JobError::retryable(format!("database: {e}")),
    }
}

pub(super) async fn write_target(
    pool: &PgPool,
    tenant: &str,
    input: &DocMigrationInput,
    op_id: Uuid,
    output: String,
    sha256: String,
) -> Result<Written, JobError> {
    let bytes = output.len();
    let store = resolve(pool, tenant, &input.target, Access::Write).await?;
    let target = match &store.location {
        Location::Dir(dir) => {
            let (dir, doc_id) = (dir.clone(), input.doc_id.clone());
            let path = tokio::task::spawn_blocking(move || {
                write_file(&dir, &doc_id, op_id, output.as_bytes())
            })
            .await
            .map_err(|e| JobError::retryable(format!("writing the document: {e}")))??;
            path.display().to_string()
        }
        Location::Table { table, .. } => {
            if output.contains('\0') {
                return Err(JobError::NonRetryable(
                    "the output contains NUL characters, which a text column cannot hold".into(),
                ));
            }
            docs::upsert_target(pool, table, &input.doc_id, &output, &sha256, op_id)
                .await
                .map_err(db_failure)?;
            format!("table:{}", table.as_str())
        }
    };
    Ok(Written {
        target,
        sha256,
        bytes,
    })
}

/// Writes `root/doc_id` atomically: a temporary file in the same directory, fsynced, renamed
/// over the target, then the directory fsynced. Writing the same bytes again leaves one file
/// with the same content. Refuses a path that resolves outside `root`.
fn write_file(root: &Path, doc_id: &str, op_id: Uuid, bytes: &[u8]) -> Result<PathBuf, JobError> {
    std::fs::create_dir_all(root)
        .map_err(|e| io_failure("creating the target store's directory", e))?;
    let root = root
        .canonicalize()
        .map_err(|e| io_failure("opening the target store's directory", e))?;
    let relative = Path::new(doc_id);
    let name = relative
        .file_name()
        .ok_or_else(|| JobError::NonRetryable("doc_id names no file".into()))?;
    let joined = root.join(relative);
    let parent = joined.parent().unwrap_or(&root);
    let inside = |dir: &Path| -> Result<PathBuf, JobError> {
        let dir = dir
            .canonicalize()
            .map_err(|e| io_failure("opening the target's directory", e))?;
        if dir.starts_with(&root) {
            Ok(dir)
        } else {
            Err(JobError::NonRetryable(
                "target path resolves outside the target store's directory".into(),
            ))
        }
    };
    // Check what exists before creating anything under it (a symlink may lead elsewhere).
    let mut existing = parent;
    while !existing.exists() {
        existing = existing.parent().unwrap_or(&root);
    }
    inside(existing)?;
    std::fs::create_dir_all(parent)
        .map_err(|e| io_failure("creating the target's directory", e))?;
    let parent = inside(parent)?;
    let dest = parent.join(name);
    let tmp = parent.join(format!(".{}.{op_id}.tmp", name.to_string_lossy()));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, &dest)?;
        std::fs::File::open(&parent)?.sync_all()
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_failure("writing the document", e)
    })?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "agentq-doc-migration-{name}-{}",
            Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn files_outside_the_roots_are_refused() {
        let base = scratch("escape");
        let (src, out) = (base.join("src"), base.join("out"));
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("sub/doc.md"), "hello").unwrap();
        std::fs::write(base.join("secret.txt"), "secret").unwrap();
        std::fs::write(src.join("bin"), [0xff, 0xfe, 0x00]).unwrap();
        std::os::unix::fs::symlink(base.join("secret.txt"), src.join("link.txt")).unwrap();
        std::os::unix::fs::symlink(&base, src.join("up")).unwrap();

        assert_eq!(read_file(&src, "sub/doc.md").unwrap(), "hello");
        let refused = |r: Result<String, JobError>| match r {
            Err(e @ JobError::NonRetryable(_)) => e.to_string(),
            other => panic!("not refused: {other:?}"),
        };
        assert!(refused(read_file(&src, "link.txt")).contains("outside the source store"));
        assert!(refused(read_file(&src, "up/secret.txt")).contains("outside the source store"));
        assert!(refused(read_file(&src, "missing.md")).contains("not found"));
        assert!(refused(read_file(&src, "sub")).contains("not a regular file"));
        assert_eq!(
            refused(read_file(&src, "bin")),
            "document is not UTF-8 text"
        );
        assert!(refused(read_file(&base.join("nope"), "a")).contains("does not exist"));

        // Writing: atomic, idempotent, never outside the root.
        let op = Uuid::new_v4();
        let dest = write_file(&out, "a/b/c.md", op, b"one").unwrap();
        assert_eq!(dest, out.canonicalize().unwrap().join("a/b/c.md"));
        write_file(&out, "a/b/c.md", op, b"one").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"one");
        let names: Vec<_> = std::fs::read_dir(out.join("a/b")).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file is left behind");
        std::os::unix::fs::symlink(&base, out.join("up")).unwrap();
        for escape in ["up/x.md", "up/new/x.md"] {
            match write_file(&out, escape, op, b"x") {
                Err(JobError::NonRetryable(m)) => {
                    assert!(m.contains("outside the target store"), "{m}")
                }
                other => panic!("{escape} not refused: {other:?}"),
            }
        }
        assert!(!base.join("x.md").exists());
        assert!(
            !base.join("new").exists(),
            "nothing is created outside the root"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn empty_and_binary_texts_are_refused() {
        assert_eq!(
            check_text(" \n\n ").unwrap_err().to_string(),
            "document is empty"
        );
        assert!(check_text("a\0b").is_err());
        assert!(check_text("fine").is_ok());
    }
}
