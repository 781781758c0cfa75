//! The enums the maps store as a `u8`: a bucket's scope and a class's action.

/// Defines an enum stored in the maps as a `u8`, with its kernel code and its user-facing
/// name side by side, once: `TryFrom<u8>` decodes the code, `name`/`from_name` and
/// `Display` spell it, `ALL` lists every variant (for "expected ..." messages).
macro_rules! named_codes {
    (
        $(#[$meta:meta])*
        pub enum $ty:ident {
            $($(#[$vmeta:meta])* $variant:ident = $code:literal, $name:literal;)*
        }
    ) => {
        $(#[$meta])*
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $ty {
            $($(#[$vmeta])* $variant = $code,)*
        }

        impl $ty {
            /// Every variant, in code order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),*];

            /// The name users write.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)*
                }
            }

            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some($ty::$variant),)*
                    _ => None,
                }
            }
        }

        impl TryFrom<u8> for $ty {
            /// The unknown code.
            type Error = u8;

            #[inline(always)]
            fn try_from(code: u8) -> Result<Self, u8> {
                match code {
                    $($code => Ok($ty::$variant),)*
                    other => Err(other),
                }
            }
        }

        impl core::fmt::Display for $ty {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named_codes! {
    /// Bucket scope: which packets share one bucket within a class.
    pub enum Scope {
        Class = 0, "class";
        Flow = 1, "flow";
        Src = 2, "src";
        Dst = 3, "dst";
    }
}

named_codes! {
    /// What happens to packets over the rate. Packets within the rate always pass
    /// untouched. `action_arg`/`action_mask` carry the parameter (DSCP value, fwmark and
    /// mask) so marking and shaping need no new map layout.
    pub enum Action {
        /// Police: drop (`TC_ACT_SHOT`).
        Drop = 0, "drop";
        /// Count only (monitor mode).
        Pass = 1, "pass";
        /// Set ECN CE on ECN-capable packets, drop the rest.
        Ecn = 2, "ecn";
        /// Rewrite DSCP to `action_arg` and pass.
        Dscp = 3, "dscp";
        /// Set `skb->mark = (mark & !action_mask) | action_arg` and pass.
        Fwmark = 4, "fwmark";
        /// Delay instead of drop: queue in shaper's HTB class (`action_arg` is its handle)
        /// or, with `action_arg` 0, pace by earliest departure time for fq; CoDel on the
        /// class's virtual queue drops or CE-marks before the queue stands.
        Shape = 5, "shape";
    }
}
