//! openraft's own storage test suite, on the RocksDB storage in a fresh temp dir per case.

use openraft::StorageError;
use openraft::testing::{StoreBuilder, Suite};
use suanli_raft::{LogStore, StateMachineStore, TypeConfig, open_db};
use suanli_state::State;
use tempfile::TempDir;

struct RocksBuilder;

type Log = LogStore<TypeConfig>;
type Sm = StateMachineStore<TypeConfig, State>;

impl StoreBuilder<TypeConfig, Log, Sm, TempDir> for RocksBuilder {
    async fn build(&self) -> Result<(TempDir, Log, Sm), StorageError<u64>> {
        let dir = tempfile::tempdir().map_err(|e| openraft::StorageIOError::write(&e))?;
        let db = open_db(dir.path()).map_err(|e| openraft::StorageIOError::write(&e))?;
        let log = LogStore::new(db.clone());
        let sm = StateMachineStore::open(db)?;
        Ok((dir, log, sm))
    }
}

#[test]
fn rocksdb_storage_passes_the_openraft_suite() {
    // The suite creates its own tokio runtime per case, so this is a plain test.
    if let Err(e) = Suite::test_all(RocksBuilder) {
        panic!("openraft storage suite failed: {e}");
    }
}
