//! Enum names spelled once: each vocabulary enum derives its strings (serde's `rename_all` and
//! strum's `serialize_all`, both snake_case, from the variant names), and a name it does not
//! know gets one readable error that lists the known ones.

use strum::VariantNames;

/// `unknown scope "x" (known: turn, session, detached)`.
pub fn unknown<T: VariantNames>(what: &str, found: &str) -> String {
    format!(
        "unknown {what} {found:?} (known: {})",
        T::VARIANTS.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use crate::execution::Scope;
    use crate::records::AgentKind;
    use crate::schedules::{Catchup, Overlap};

    #[test]
    fn names_parse_print_and_serialise_alike() {
        for (text, kind) in [("mock", AgentKind::Mock), ("tmux", AgentKind::Tmux)] {
            assert_eq!(text.parse::<AgentKind>(), Ok(kind));
            assert_eq!(kind.to_string(), text);
            assert_eq!(serde_json::to_value(kind).expect("json"), text);
        }
        assert_eq!("buffer_one".parse::<Overlap>(), Ok(Overlap::BufferOne));
        assert_eq!(Overlap::CancelOther.to_string(), "cancel_other");
        assert_eq!(
            serde_json::to_value(Overlap::AllowAll).expect("json"),
            "allow_all"
        );
        assert_eq!("none".parse::<Catchup>(), Ok(Catchup::None));
        assert_eq!(Scope::Detached.to_string(), "detached");
        assert_eq!(
            "forever".parse::<Scope>(),
            Err("unknown scope \"forever\" (known: turn, session, detached)".to_string())
        );
        assert_eq!(
            "bogus".parse::<Overlap>(),
            Err("unknown overlap policy \"bogus\" (known: skip, buffer_one, allow_all, cancel_other)".to_string())
        );
    }
}
